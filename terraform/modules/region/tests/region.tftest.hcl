mock_provider "aws" {}

variables {
  name              = "eu-west-1"
  availability_zone = "eu-west-1a"
  ami_id            = "ami-0123456789abcdef0"
  replica_count     = 3
  peer_cidrs        = ["10.10.0.0/16", "10.30.0.0/16"]
  skymesh_config    = "model: x"
  credentials = {
    secret_arns = [
      "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/ca-cert-AAAAAA",
      "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/peer-token-BBBBBB",
      "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/balancer/eu-west-1-CCCCCC",
    ]
    fetch_script = "#!/bin/bash\necho fetch eu-west-1\n"
  }
}

run "hardened_instances_and_vllm_with_prefix_caching" {
  command = plan

  assert {
    condition     = length(aws_instance.replica) == 3
    error_message = "replica_count instances expected"
  }
  assert {
    condition     = alltrue([for i in aws_instance.replica : i.metadata_options[0].http_tokens == "required"]) && aws_instance.balancer.metadata_options[0].http_tokens == "required"
    error_message = "IMDSv2 only"
  }
  assert {
    condition     = alltrue([for i in aws_instance.replica : i.root_block_device[0].encrypted]) && aws_instance.balancer.root_block_device[0].encrypted
    error_message = "encrypted root volumes"
  }
  assert {
    condition     = strcontains(aws_instance.replica[0].user_data, "--enable-prefix-caching")
    error_message = "vLLM must run with prefix caching"
  }
  assert {
    condition     = strcontains(aws_instance.balancer.user_data, "skymesh balancer --config /etc/skymesh/mesh.yaml --region eu-west-1")
    error_message = "the balancer runs skymesh balancer for its region"
  }
  assert {
    condition     = strcontains(aws_instance.balancer.user_data, "ExecReload=/bin/kill -HUP $MAINPID")
    error_message = "systemctl reload skymesh-balancer sends SIGHUP (a config reload)"
  }
  assert {
    condition     = strcontains(aws_instance.balancer.user_data, "TimeoutStopSec=45")
    error_message = "systemd gives the SIGTERM drain (30 s) time before SIGKILL"
  }
}

run "replica_port_only_from_balancer_and_peers" {
  command = plan

  assert {
    condition     = length([for r in aws_security_group.replica.ingress : r if r.from_port != 8000]) == 0
    error_message = "replicas expose only port 8000"
  }
}

run "peer_forwards_port_only_from_peers" {
  command = plan

  assert {
    condition     = length([for r in aws_security_group.balancer.ingress : r if r.from_port == 8443 && r.to_port == 8443 && toset(r.cidr_blocks) == toset(var.peer_cidrs)]) == 1
    error_message = "the peer listener (8443, mTLS forwards) is open to peer networks only"
  }
}

run "rejects_zero_replicas" {
  command = plan
  variables {
    replica_count = 0
  }
  expect_failures = [var.replica_count]
}

run "balancer_has_a_fixed_public_address" {
  command = plan

  assert {
    condition     = aws_eip.balancer.domain == "vpc"
    error_message = "the balancer's public address is an Elastic IP allocated before the instance"
  }
}

run "balancer_role_reads_only_its_credentials" {
  command = plan

  assert {
    condition     = length(jsondecode(aws_iam_role_policy.balancer_credentials.policy).Statement) == 1
    error_message = "without a customer key the role has one statement"
  }
  assert {
    condition     = tolist(jsondecode(aws_iam_role_policy.balancer_credentials.policy).Statement[0].Action) == tolist(["secretsmanager:GetSecretValue"]) && jsondecode(aws_iam_role_policy.balancer_credentials.policy).Statement[0].Effect == "Allow"
    error_message = "the balancer may only read secret values"
  }
  assert {
    condition     = tolist(jsondecode(aws_iam_role_policy.balancer_credentials.policy).Statement[0].Resource) == var.credentials.secret_arns
    error_message = "exactly the secrets it was given, no wildcard"
  }
  assert {
    condition     = output.credentials_policy == aws_iam_role_policy.balancer_credentials.policy
    error_message = "the output is the attached policy"
  }
  assert {
    condition     = jsondecode(aws_iam_role.balancer.assume_role_policy).Statement[0].Principal.Service == "ec2.amazonaws.com"
    error_message = "only EC2 assumes the balancer role"
  }
  assert {
    condition     = aws_instance.balancer.iam_instance_profile == aws_iam_instance_profile.balancer.name
    error_message = "the balancer instance gets the role"
  }
}

run "balancer_fetches_credentials_before_every_start" {
  command = plan

  assert {
    condition     = strcontains(aws_instance.balancer.user_data, "content: ${base64encode(var.credentials.fetch_script)}") && strcontains(aws_instance.balancer.user_data, "path: /usr/local/sbin/skymesh-fetch-credentials")
    error_message = "the fetch script is written to the instance"
  }
  assert {
    condition     = strcontains(aws_instance.balancer.user_data, "ExecStartPre=/usr/local/sbin/skymesh-fetch-credentials") && strcontains(aws_instance.balancer.user_data, "EnvironmentFile=-/etc/skymesh/pki/peer-token.env")
    error_message = "systemd fetches the credentials before each start and passes the peer token in the environment"
  }
}

run "customer_key_decrypt_only_through_secrets_manager" {
  command = plan
  variables {
    credentials = {
      secret_arns  = ["arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/ca-cert-AAAAAA"]
      kms_key_arn  = "arn:aws:kms:us-east-1:123456789012:key/0e7d1c4a-1111-2222-3333-444455556666"
      fetch_script = "#!/bin/bash\n"
    }
  }

  assert {
    condition     = tolist(jsondecode(aws_iam_role_policy.balancer_credentials.policy).Statement[1].Action) == tolist(["kms:Decrypt"]) && tolist(jsondecode(aws_iam_role_policy.balancer_credentials.policy).Statement[1].Resource) == tolist([var.credentials.kms_key_arn])
    error_message = "kms:Decrypt on the given key only"
  }
  assert {
    condition     = jsondecode(aws_iam_role_policy.balancer_credentials.policy).Statement[1].Condition.StringEquals["kms:ViaService"] == "secretsmanager.us-east-1.amazonaws.com"
    error_message = "the key decrypts only for Secrets Manager in the secrets' region"
  }
}

run "rejects_wildcard_secret_arns" {
  command = plan
  variables {
    credentials = {
      secret_arns  = ["arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/*"]
      fetch_script = "#!/bin/bash\n"
    }
  }
  expect_failures = [var.credentials]
}

run "security_group_rule_descriptions_use_the_characters_aws_accepts" {
  # apply against the mock provider (nothing real): the replica group's rules name the
  # balancer group's id, unknown in a plan
  command = apply

  assert {
    # EC2 accepts a-z A-Z 0-9 space and ._-:/()#,@[]+=&;{}!$* in rule descriptions (no
    # apostrophe): a mock plan does not check it, AWS rejects the apply
    condition = alltrue([for d in flatten([
      for sg in [aws_security_group.balancer, aws_security_group.replica] : [for r in concat(tolist(sg.ingress), tolist(sg.egress)) : r.description]
    ]) : can(regex("^[0-9A-Za-z_ .:/()#,@\\[\\]+=&;{}!$*-]*$", d))])
    error_message = "a security group rule description holds a character EC2 rejects"
  }
}
