variables {
  dns_name      = "llm.example.com"
  hosted_zone   = "example.com"
  controller_ip = "10.10.0.5"
  peer_token    = "0123456789abcdef0123"
  regions = [
    { name = "us-east-1", source_networks = ["10.10.0.0/16"], balancer_private_ip = "10.10.0.10", balancer_public_ip = "3.80.0.10", replica_ips = ["10.10.1.10", "10.10.1.11"] },
    { name = "eu-west-1", source_networks = ["10.20.0.0/16"], balancer_private_ip = "10.20.0.10", replica_ips = ["10.20.1.10"] },
  ]
  latencies = [{ regions = ["us-east-1", "eu-west-1"], one_way_ms = 38 }]
}

run "renders_the_config" {
  command = plan

  assert {
    condition     = length(yamldecode(output.skymesh_config).regions) == 2
    error_message = "two regions expected in the rendered config"
  }
  assert {
    condition     = yamldecode(output.skymesh_config).regions[0].replicas[1].url == "http://10.10.1.11:8000"
    error_message = "replica URLs must come from replica_ips and replica_port"
  }
  assert {
    condition     = yamldecode(output.skymesh_config).regions[0].balancer.public_ip == "3.80.0.10"
    error_message = "public_ip must be passed through"
  }
  assert {
    condition     = yamldecode(output.skymesh_config).dns.provider == "route53"
    error_message = "the AWS deployment uses the Route53 provider"
  }
}

run "rejects_bad_policy" {
  command = plan
  variables {
    policy = { name = "random" }
  }
  expect_failures = [var.policy]
}

run "rejects_region_without_replicas" {
  command = plan
  variables {
    regions = [{ name = "us-east-1", source_networks = ["10.10.0.0/16"], balancer_private_ip = "10.10.0.10", replica_ips = [] }]
  }
  expect_failures = [var.regions]
}

run "rejects_bad_cidr_and_short_token" {
  command = plan
  variables {
    regions    = [{ name = "us-east-1", source_networks = ["10.10.0.1/33"], balancer_private_ip = "10.10.0.10", replica_ips = ["10.10.1.10"] }]
    peer_token = "short"
  }
  expect_failures = [var.regions, var.peer_token]
}
