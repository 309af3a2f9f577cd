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
