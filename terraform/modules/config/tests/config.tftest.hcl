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

run "no_credentials_dir_no_tls_section" {
  command = plan

  assert {
    condition     = !contains(keys(yamldecode(output.skymesh_config)), "tls") && !contains(keys(yamldecode(output.skymesh_config)), "admin")
    error_message = "without credentials_dir the config has no tls or admin section"
  }
}

run "credentials_dir_renders_tls_paths_and_token_file" {
  command = plan
  variables {
    credentials_dir = "/etc/skymesh/pki/"
    peer_token      = null
  }

  assert {
    condition     = yamldecode(output.skymesh_config).tls.ca_cert == "/etc/skymesh/pki/ca.crt"
    error_message = "tls.ca_cert is ca.crt in credentials_dir"
  }
  assert {
    condition     = yamldecode(output.skymesh_config).tls.controller == { cert = "/etc/skymesh/pki/controller.crt", key = "/etc/skymesh/pki/controller.key" }
    error_message = "tls.controller names controller.{crt,key}"
  }
  assert {
    condition     = yamldecode(output.skymesh_config).tls.balancers == { "us-east-1" = { cert = "/etc/skymesh/pki/balancer-us-east-1.crt", key = "/etc/skymesh/pki/balancer-us-east-1.key" }, "eu-west-1" = { cert = "/etc/skymesh/pki/balancer-eu-west-1.crt", key = "/etc/skymesh/pki/balancer-eu-west-1.key" } }
    error_message = "tls.balancers names every region's balancer-<region>.{crt,key}"
  }
  assert {
    condition     = yamldecode(output.skymesh_config).admin.token_file == "/etc/skymesh/pki/admin-token"
    error_message = "the admin token is read from credentials_dir/admin-token"
  }
  assert {
    condition     = !contains(keys(yamldecode(output.skymesh_config)), "peer_token") && !strcontains(output.skymesh_config, "0123456789abcdef0123")
    error_message = "with the peer token delivered apart, the config holds no secret"
  }
}

run "rejects_a_relative_credentials_dir" {
  command = plan
  variables {
    credentials_dir = "etc/skymesh"
  }
  expect_failures = [var.credentials_dir]
}

run "no_autoscaling_no_section" {
  command = plan

  assert {
    condition     = !contains(keys(yamldecode(output.skymesh_config)), "autoscaling")
    error_message = "without autoscaling the balancers publish nothing"
  }
}

run "autoscaling_renders_the_cloudwatch_section" {
  command = plan
  variables {
    autoscaling = { interval_s = 30 }
  }

  assert {
    condition     = yamldecode(output.skymesh_config).autoscaling == { cloudwatch = { namespace = "SkyMesh", metric_name = "PendingPrefillSecondsPerReplica", interval_s = 30 } }
    error_message = "the signal's namespace, metric and interval, as the region module's policy tracks them"
  }
}

run "rejects_a_zero_interval" {
  command = plan
  variables {
    autoscaling = { interval_s = 0 }
  }
  expect_failures = [var.autoscaling]
}
