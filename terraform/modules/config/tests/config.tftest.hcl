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
  assert {
    condition     = alltrue([for r in yamldecode(output.skymesh_config).regions : r.balancer.fleet == "registered" && !contains(keys(r.balancer), "siblings")])
    error_message = "every region's balancers are a registered fleet (an Auto Scaling group), listed nowhere"
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

run "no_replica_groups_no_membership_section" {
  command = plan

  assert {
    condition     = !contains(keys(yamldecode(output.skymesh_config)), "membership")
    error_message = "without replica Auto Scaling groups the controller discovers nothing"
  }
}

run "replica_groups_render_membership_aws_per_aws_region" {
  command = plan
  variables {
    regions = [
      { name = "us-east-1", source_networks = ["10.10.0.0/16"], balancer_private_ip = "10.10.0.10", replica_ips = ["10.10.1.10"], replica_asg_names = ["skymesh-us-east-1-replica"] },
      { name = "us-east-1-edge", aws_region = "us-east-1", source_networks = ["10.11.0.0/16"], balancer_private_ip = "10.11.0.10", replica_ips = [], replica_asg_names = ["skymesh-us-east-1-edge-replica"] },
      { name = "eu-west-1", source_networks = ["10.20.0.0/16"], balancer_private_ip = "10.20.0.10", replica_ips = [], replica_asg_names = ["skymesh-eu-west-1-replica"] },
      { name = "ap-northeast-1", source_networks = ["10.30.0.0/16"], balancer_private_ip = "10.30.0.10", replica_ips = ["10.30.1.10"] },
    ]
    replica_discovery = { port = 8001, scheme = "https", poll_interval_s = 10, drain_grace_s = 45 }
  }

  assert {
    condition     = yamldecode(output.skymesh_config).membership.drain_grace_s == 45
    error_message = "a replica its group drops drains for replica_discovery.drain_grace_s"
  }
  assert {
    condition = yamldecode(output.skymesh_config).membership.aws == [
      {
        aws_region          = "eu-west-1", port = 8001, scheme = "https", poll_interval_s = 10
        auto_scaling_groups = [{ name = "skymesh-eu-west-1-replica", region = "eu-west-1" }]
      },
      {
        aws_region = "us-east-1", port = 8001, scheme = "https", poll_interval_s = 10
        auto_scaling_groups = [
          { name = "skymesh-us-east-1-replica", region = "us-east-1" },
          { name = "skymesh-us-east-1-edge-replica", region = "us-east-1-edge" },
        ]
      },
    ]
    error_message = "one membership.aws entry per AWS region with groups, listing each group with the mesh region its replicas serve"
  }
  assert {
    condition     = [for r in yamldecode(output.skymesh_config).regions : length(r.replicas)] == [1, 0, 0, 1]
    error_message = "a region with a replica group may list no static replicas"
  }
}

run "rejects_a_group_in_two_regions" {
  command = plan
  variables {
    regions = [
      { name = "us-east-1", source_networks = ["10.10.0.0/16"], balancer_private_ip = "10.10.0.10", replica_ips = ["10.10.1.10"], replica_asg_names = ["skymesh-replica"] },
      { name = "eu-west-1", source_networks = ["10.20.0.0/16"], balancer_private_ip = "10.20.0.10", replica_ips = ["10.20.1.10"], replica_asg_names = ["skymesh-replica"] },
    ]
  }
  expect_failures = [var.regions]
}

run "rejects_a_bad_replica_scheme_and_poll_interval" {
  command = plan
  variables {
    replica_discovery = { scheme = "grpc", poll_interval_s = 0 }
  }
  expect_failures = [var.replica_discovery]
}

run "entry_target_groups_pass_through" {
  command = plan
  variables {
    regions = [
      { name = "us-east-1", source_networks = ["10.10.0.0/16"], balancer_private_ip = "10.10.0.10", replica_ips = ["10.10.1.10"],
      entry_target_group_arns = ["arn:aws:elasticloadbalancing:us-east-1:123456789012:targetgroup/skymesh-use1-entry-http/50dc6c495c0c9188"] },
      { name = "eu-west-1", source_networks = ["10.20.0.0/16"], balancer_private_ip = "10.20.0.10", replica_ips = ["10.20.1.10"] },
    ]
  }

  assert {
    condition     = yamldecode(output.skymesh_config).regions[0].balancer.entry_target_groups == ["arn:aws:elasticloadbalancing:us-east-1:123456789012:targetgroup/skymesh-use1-entry-http/50dc6c495c0c9188"]
    error_message = "the region's target groups are rendered as balancer.entry_target_groups"
  }
  assert {
    condition     = !contains(keys(yamldecode(output.skymesh_config).regions[1].balancer), "entry_target_groups")
    error_message = "a region without target groups renders none"
  }
}

run "rejects_a_target_group_of_another_region" {
  command = plan
  variables {
    regions = [{ name = "us-east-1", source_networks = ["10.10.0.0/16"], balancer_private_ip = "10.10.0.10", replica_ips = ["10.10.1.10"],
    entry_target_group_arns = ["arn:aws:elasticloadbalancing:eu-west-1:123456789012:targetgroup/skymesh-use1-entry-http/50dc6c495c0c9188"] }]
  }
  expect_failures = [var.regions]
}
