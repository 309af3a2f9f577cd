mock_provider "aws" {
  override_data {
    target = data.aws_iam_policy_document.assume
    values = { json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}" }
  }
  override_data {
    target = data.aws_iam_policy_document.route53
    values = { json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}" }
  }
}

variables {
  subnet_id      = "subnet-0123"
  vpc_id         = "vpc-0123"
  ami_id         = "ami-0123456789abcdef0"
  hosted_zone_id = "Z0123456789ABC"
  balancer_cidrs = ["10.10.0.0/16"]
  skymesh_config = "model: x"
  credentials = {
    secret_arns = [
      "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/ca-cert-AAAAAA",
      "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/admin-token-DDDDDD",
      "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/controller-EEEEEE",
    ]
    fetch_script = "#!/bin/bash\necho fetch controller\n"
  }
}

run "controller_is_hardened" {
  command = plan

  assert {
    condition     = aws_instance.this.metadata_options[0].http_tokens == "required" && aws_instance.this.root_block_device[0].encrypted
    error_message = "IMDSv2 only and encrypted root volume"
  }
  assert {
    condition     = length([for r in aws_security_group.this.ingress : r if r.from_port == 7002]) == 0
    error_message = "the status API stays closed unless admin_cidrs are given"
  }
}

run "rejects_bad_zone_id" {
  command = plan
  variables {
    hosted_zone_id = "example.com"
  }
  expect_failures = [var.hosted_zone_id]
}

run "fixed_private_ip" {
  command = plan
  variables {
    private_ip = "10.10.0.5"
  }

  assert {
    condition     = aws_instance.this.private_ip == "10.10.0.5"
    error_message = "the controller must sit at the address the config names"
  }
}

run "rejects_bad_private_ip" {
  command = plan
  variables {
    private_ip = "10.10.0"
  }
  expect_failures = [var.private_ip]
}

run "controller_role_reads_only_its_credentials" {
  command = plan

  assert {
    condition     = length(jsondecode(aws_iam_role_policy.credentials.policy).Statement) == 1 && jsondecode(aws_iam_role_policy.credentials.policy).Statement[0].Effect == "Allow"
    error_message = "without a customer key the credentials policy has one statement"
  }
  assert {
    condition     = tolist(jsondecode(aws_iam_role_policy.credentials.policy).Statement[0].Action) == tolist(["secretsmanager:GetSecretValue"]) && tolist(jsondecode(aws_iam_role_policy.credentials.policy).Statement[0].Resource) == var.credentials.secret_arns
    error_message = "the controller may read exactly the secrets it was given"
  }
  assert {
    condition     = output.credentials_policy == aws_iam_role_policy.credentials.policy
    error_message = "the output is the attached policy"
  }
  assert {
    condition     = strcontains(aws_instance.this.user_data, "ExecStartPre=/usr/local/sbin/skymesh-fetch-credentials") && strcontains(aws_instance.this.user_data, "content: ${base64encode(var.credentials.fetch_script)}")
    error_message = "systemd fetches the controller's credentials before each start"
  }
}

run "rejects_wildcard_secret_arns" {
  command = plan
  variables {
    credentials = { secret_arns = ["*"], fetch_script = "#!/bin/bash\n" }
  }
  expect_failures = [var.credentials]
}

run "replica_membership_is_off_by_default" {
  command = plan

  assert {
    condition     = length(aws_iam_role_policy.discovery) == 0
    error_message = "no discovery permissions unless replica_discovery is set"
  }
  assert {
    condition     = output.replica_discovery_policy == null
    error_message = "the output says no discovery policy is attached"
  }
}

run "replica_membership_opens_what_it_needs" {
  command = plan
  variables {
    replica_discovery = true
    replica_cidrs     = ["10.20.0.0/16"]
  }

  assert {
    condition     = tolist(jsondecode(aws_iam_role_policy.discovery[0].policy).Statement[0].Action) == tolist(["autoscaling:DescribeAutoScalingGroups", "ec2:DescribeInstances"])
    error_message = "discovery is read-only: the two Describe calls"
  }
  assert {
    condition     = output.replica_discovery_policy == aws_iam_role_policy.discovery[0].policy
    error_message = "the output is the attached discovery policy"
  }
  assert {
    condition     = !contains(keys(jsondecode(output.replica_discovery_policy).Statement[0]), "Condition")
    error_message = "without replica_discovery_regions, any region"
  }
  assert {
    condition     = length([for r in aws_security_group.this.ingress : r if r.from_port == 7002 && contains(r.cidr_blocks, "10.20.0.0/16")]) == 1
    error_message = "the registration API opens to the replicas' networks"
  }
}

run "replica_discovery_only_in_the_replicas_regions" {
  command = plan
  variables {
    replica_discovery         = true
    replica_discovery_regions = ["us-east-1", "eu-west-1", "us-east-1"]
  }

  assert {
    condition     = jsondecode(output.replica_discovery_policy).Statement[0].Condition == { StringEquals = { "aws:RequestedRegion" = ["eu-west-1", "us-east-1"] } }
    error_message = "the Describe calls are allowed in the replicas' AWS regions only"
  }
  assert {
    condition     = jsondecode(output.replica_discovery_policy).Statement[0].Resource == "*"
    error_message = "the Describe APIs take no resource-level permissions"
  }
}

run "rejects_a_discovery_region_that_is_not_an_aws_region" {
  command = plan
  variables {
    replica_discovery         = true
    replica_discovery_regions = ["europe"]
  }
  expect_failures = [var.replica_discovery_regions]
}

run "entry_targets_are_off_by_default" {
  command = plan

  assert {
    condition     = length(aws_iam_role_policy.entry_targets) == 0 && output.entry_targets_policy == null
    error_message = "no target group permissions unless entry_target_group_arns is set"
  }
}

run "entry_targets_move_only_the_named_groups" {
  command = plan
  variables {
    entry_target_group_arns = [
      "arn:aws:elasticloadbalancing:us-east-1:123456789012:targetgroup/skymesh-use1-entry-http/50dc6c495c0c9188",
      "arn:aws:elasticloadbalancing:eu-west-1:123456789012:targetgroup/skymesh-euw1-entry-http/60dc6c495c0c9188",
    ]
  }

  assert {
    condition     = tolist(jsondecode(output.entry_targets_policy).Statement[0].Action) == tolist(["elasticloadbalancing:DeregisterTargets", "elasticloadbalancing:RegisterTargets"])
    error_message = "the controller may only move targets in and out"
  }
  assert {
    condition     = length(jsondecode(output.entry_targets_policy).Statement[0].Resource) == 2
    error_message = "on the named target groups only"
  }
}

run "rejects_a_wildcard_target_group" {
  command = plan
  variables {
    entry_target_group_arns = ["arn:aws:elasticloadbalancing:us-east-1:123456789012:targetgroup/*"]
  }
  expect_failures = [var.entry_target_group_arns]
}
