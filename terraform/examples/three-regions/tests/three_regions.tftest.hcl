# The whole example planned against mock providers: no dependency cycle between the
# Elastic IPs, the rendered config and the instances, and the config names the addresses
# the instances and the Route53 records get.
mock_provider "aws" {
  alias           = "use1"
  override_during = plan
}

mock_provider "aws" {
  alias           = "euw1"
  override_during = plan
}

mock_provider "aws" {
  alias           = "apne1"
  override_during = plan
}

override_resource {
  target          = module.use1.aws_eip.balancer
  values          = { public_ip = "3.80.0.10" }
  override_during = plan
}

override_resource {
  target          = module.euw1.aws_eip.balancer
  values          = { public_ip = "52.16.0.10" }
  override_during = plan
}

override_resource {
  target          = module.apne1.aws_eip.balancer
  values          = { public_ip = "13.112.0.10" }
  override_during = plan
}

override_data {
  target = module.controller.data.aws_iam_policy_document.assume
  values = { json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}" }
}

override_data {
  target = module.controller.data.aws_iam_policy_document.route53
  values = { json = "{\"Version\":\"2012-10-17\",\"Statement\":[]}" }
}

override_data {
  target = module.dns.data.aws_route53_zone.this
  values = { zone_id = "Z0123456789ABC" }
}

variables {
  amis            = { "us-east-1" = "ami-0123456789abcdef0", "eu-west-1" = "ami-0123456789abcdef1", "ap-northeast-1" = "ami-0123456789abcdef2" }
  dns_name        = "llm.example.com"
  hosted_zone     = "example.com"
  peer_token      = "0123456789abcdef0123456789abcdef"
  skymesh_package = "skymesh @ https://example.com/skymesh-0.1.0-py3-none-any.whl"
}

run "config_names_the_planned_addresses" {
  command = plan

  assert {
    condition     = { for r in yamldecode(output.skymesh_config).regions : r.name => r.balancer.public_ip } == { "us-east-1" = "3.80.0.10", "eu-west-1" = "52.16.0.10", "ap-northeast-1" = "13.112.0.10" }
    error_message = "the config must publish each balancer's Elastic IP"
  }
  assert {
    condition     = yamldecode(output.skymesh_config).controller.listen == "${module.controller.private_ip}:7001"
    error_message = "the config must name the controller's fixed private address"
  }
  assert {
    condition     = module.dns.record_set_identifiers["eu-west-1"] == "skymesh-eu-west-1"
    error_message = "one latency record per region"
  }
}
