mock_provider "aws" {}

variables {
  name              = "eu-west-1"
  availability_zone = "eu-west-1a"
  ami_id            = "ami-0123456789abcdef0"
  replica_count     = 3
  peer_cidrs        = ["10.10.0.0/16", "10.30.0.0/16"]
  skymesh_config    = "model: x"
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
}

run "replica_port_only_from_balancer_and_peers" {
  command = plan

  assert {
    condition     = length([for r in aws_security_group.replica.ingress : r if r.from_port != 8000]) == 0
    error_message = "replicas expose only port 8000"
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
