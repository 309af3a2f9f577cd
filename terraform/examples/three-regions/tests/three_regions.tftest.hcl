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
  target          = module.use1.aws_eip.entry
  values          = { public_ip = "3.80.0.10" }
  override_during = plan
}

override_resource {
  target          = module.euw1.aws_eip.entry
  values          = { public_ip = "52.16.0.10" }
  override_during = plan
}

override_resource {
  target          = module.apne1.aws_eip.entry
  values          = { public_ip = "13.112.0.10" }
  override_during = plan
}

# the balancers' target groups get their ARNs at apply; fixed here so the config (which
# names them) is known in the plan (every listener's group gets this one ARN)
override_resource {
  target          = module.use1.aws_lb_target_group.balancer
  values          = { arn = "arn:aws:elasticloadbalancing:us-east-1:123456789012:targetgroup/skymesh-use1/0123456789abcdef" }
  override_during = plan
}

# the balancers' target groups get their ARNs at apply; fixed here so the config (which
# names them) is known in the plan (every listener's group gets this one ARN)
override_resource {
  target          = module.euw1.aws_lb_target_group.balancer
  values          = { arn = "arn:aws:elasticloadbalancing:eu-west-1:123456789012:targetgroup/skymesh-euw1/0123456789abcdef" }
  override_during = plan
}

# the balancers' target groups get their ARNs at apply; fixed here so the config (which
# names them) is known in the plan (every listener's group gets this one ARN)
override_resource {
  target          = module.apne1.aws_lb_target_group.balancer
  values          = { arn = "arn:aws:elasticloadbalancing:ap-northeast-1:123456789012:targetgroup/skymesh-apne1/0123456789abcdef" }
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
  credentials_dir = "tests/credentials"
  skymesh_package = "skymesh @ https://example.com/skymesh-0.1.0-py3-none-any.whl"
}

run "config_names_the_planned_addresses" {
  command = plan

  assert {
    condition     = { for r in yamldecode(output.skymesh_config).regions : r.name => r.balancer.public_ip } == { "us-east-1" = "3.80.0.10", "eu-west-1" = "52.16.0.10", "ap-northeast-1" = "13.112.0.10" }
    error_message = "the config must publish each region's entry Elastic IP"
  }
  assert {
    condition     = { for r in yamldecode(output.skymesh_config).regions : r.name => [r.balancer.advertise, r.balancer.grpc_advertise, r.balancer.peer_advertise] } == { "us-east-1" = ["10.10.0.10:8000", "10.10.0.10:9000", "10.10.0.10:8443"], "eu-west-1" = ["10.20.0.10:8000", "10.20.0.10:9000", "10.20.0.10:8443"], "ap-northeast-1" = ["10.30.0.10:8000", "10.30.0.10:9000", "10.30.0.10:8443"] }
    error_message = "peers and the controller reach each region at its mesh load balancer's fixed private IP"
  }
  assert {
    condition     = module.euw1.balancer_private_ips == ["10.20.0.10", "10.20.1.10"]
    error_message = "the mesh load balancer sits at the address the config advertises"
  }
  assert {
    condition     = yamldecode(output.skymesh_config).autoscaling.cloudwatch == { namespace = "SkyMesh", metric_name = "PendingPrefillSecondsPerReplica", interval_s = 60 }
    error_message = "every balancer publishes the signal the replicas' policy tracks"
  }
  assert {
    condition     = alltrue([for m in [module.use1, module.euw1, module.apne1] : m.replica_scaling_metric.name == yamldecode(output.skymesh_config).autoscaling.cloudwatch.metric_name && m.replica_scaling_metric.namespace == yamldecode(output.skymesh_config).autoscaling.cloudwatch.namespace]) && module.apne1.replica_scaling_metric.region == "ap-northeast-1"
    error_message = "the policy tracks the metric the config publishes"
  }
  assert {
    condition     = yamldecode(output.skymesh_config).controller.listen == "${module.controller.private_ip}:7001"
    error_message = "the config must name the controller's fixed private address"
  }
  assert {
    condition     = yamldecode(output.skymesh_config).regions[1].balancer.entry_target_groups == ["arn:aws:elasticloadbalancing:eu-west-1:123456789012:targetgroup/skymesh-euw1/0123456789abcdef"]
    error_message = "the config names each region's target groups: the controller takes a dead balancer out of them"
  }
  assert {
    condition     = module.dns.record_set_identifiers["eu-west-1"] == "skymesh-eu-west-1"
    error_message = "one latency record per region"
  }
}

# The wiring: each region module gets its own region's entry of the secrets module, the
# controller the controller's (the secrets module's own tests check what each entry
# lists). The module's outputs are fixed here, so every ARN is known in the plan.
run "each_role_reads_only_its_own_credentials" {
  command = plan

  override_module {
    target = module.secrets
    outputs = {
      host_dir = "/etc/skymesh/pki"
      secret_arns = {
        "ca-cert"                 = "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/ca-cert-AAAAAA"
        "peer-token"              = "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/peer-token-BBBBBB"
        "admin-token"             = "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/admin-token-CCCCCC"
        "controller"              = "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/controller-DDDDDD"
        "balancer/us-east-1"      = "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/balancer/us-east-1-EEEEEE"
        "balancer/eu-west-1"      = "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/balancer/eu-west-1-FFFFFF"
        "balancer/ap-northeast-1" = "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/balancer/ap-northeast-1-GGGGGG"
      }
      balancers = {
        "us-east-1" = {
          secret_arns  = ["arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/ca-cert-AAAAAA", "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/peer-token-BBBBBB", "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/balancer/us-east-1-EEEEEE"]
          kms_key_arn  = null
          fetch_script = "#!/bin/bash\n# us-east-1\n"
        }
        "eu-west-1" = {
          secret_arns  = ["arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/ca-cert-AAAAAA", "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/peer-token-BBBBBB", "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/balancer/eu-west-1-FFFFFF"]
          kms_key_arn  = null
          fetch_script = "#!/bin/bash\n# eu-west-1\n"
        }
        "ap-northeast-1" = {
          secret_arns  = ["arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/ca-cert-AAAAAA", "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/peer-token-BBBBBB", "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/balancer/ap-northeast-1-GGGGGG"]
          kms_key_arn  = null
          fetch_script = "#!/bin/bash\n# ap-northeast-1\n"
        }
      }
      controller = {
        secret_arns  = ["arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/ca-cert-AAAAAA", "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/admin-token-CCCCCC", "arn:aws:secretsmanager:us-east-1:123456789012:secret:skymesh/controller-DDDDDD"]
        kms_key_arn  = null
        fetch_script = "#!/bin/bash\n# controller\n"
      }
    }
  }

  assert {
    condition = alltrue([for r, p in output.balancer_credentials_policies : tolist(jsondecode(p).Statement[0].Resource) == tolist([
      output.secret_arns["ca-cert"], output.secret_arns["peer-token"], output.secret_arns["balancer/${r}"],
    ])])
    error_message = "each balancer role reads the CA certificate, the peer token and its own region's pair"
  }
  assert {
    condition = alltrue(flatten([for r, p in output.balancer_credentials_policies : [
      for k, arn in output.secret_arns : !contains(jsondecode(p).Statement[0].Resource, arn) if !contains(["ca-cert", "peer-token", "balancer/${r}"], k)
    ]]))
    error_message = "no balancer role may read another region's key, the controller's key or the admin token"
  }
  assert {
    condition     = tolist(jsondecode(output.controller_credentials_policy).Statement[0].Resource) == tolist([output.secret_arns["ca-cert"], output.secret_arns["admin-token"], output.secret_arns["controller"]])
    error_message = "the controller role reads the CA certificate, the admin token and its own pair, nothing else"
  }
}

run "config_points_tls_at_the_fetched_files_and_holds_no_secret" {
  command = plan

  assert {
    condition     = yamldecode(output.skymesh_config).tls.balancers["ap-northeast-1"] == { cert = "/etc/skymesh/pki/balancer-ap-northeast-1.crt", key = "/etc/skymesh/pki/balancer-ap-northeast-1.key" } && yamldecode(output.skymesh_config).tls.ca_cert == "/etc/skymesh/pki/ca.crt"
    error_message = "the config's tls section names the files the fetch scripts write"
  }
  assert {
    condition     = yamldecode(output.skymesh_config).admin.token_file == "/etc/skymesh/pki/admin-token"
    error_message = "the controller reads the admin token from the fetched file"
  }
  assert {
    condition     = !strcontains(output.skymesh_config, "placeholder") && !contains(keys(yamldecode(output.skymesh_config)), "peer_token")
    error_message = "no credential in the config every instance receives in its user data"
  }
}

# The scaling pool's replicas join through the controller: the config names every
# region's replica group (the name each region module creates, known at plan), the
# controller may list them, and a terminated instance waits out a poll and the drain.
run "replica_groups_join_through_the_controller" {
  command = plan

  assert {
    condition = { for s in yamldecode(output.skymesh_config).membership.aws : s.aws_region => s.auto_scaling_groups } == {
      "us-east-1"      = [{ name = module.use1.replica_asg_name, region = "us-east-1" }]
      "eu-west-1"      = [{ name = module.euw1.replica_asg_name, region = "eu-west-1" }]
      "ap-northeast-1" = [{ name = module.apne1.replica_asg_name, region = "ap-northeast-1" }]
    }
    error_message = "membership.aws lists each region's replica group, in its AWS region, as that region's replicas"
  }
  assert {
    condition     = [module.use1.replica_asg_name, module.euw1.replica_asg_name, module.apne1.replica_asg_name] == ["skymesh-us-east-1-replica", "skymesh-eu-west-1-replica", "skymesh-ap-northeast-1-replica"] && output.autoscaling_groups["eu-west-1"].replicas == "skymesh-eu-west-1-replica"
    error_message = "the groups the config names are the ones the region modules create"
  }
  assert {
    condition     = alltrue([for s in yamldecode(output.skymesh_config).membership.aws : s.port == 8000 && s.scheme == "http" && s.poll_interval_s == 15]) && yamldecode(output.skymesh_config).membership.drain_grace_s == 30
    error_message = "the controller polls every 15 s for replicas serving vLLM on http port 8000 and drains a leaving one for 30 s"
  }
  assert {
    condition     = tolist(jsondecode(module.controller.replica_discovery_policy).Statement[0].Action) == tolist(["autoscaling:DescribeAutoScalingGroups", "ec2:DescribeInstances"])
    error_message = "the controller role may list the groups and their instances"
  }
  assert {
    condition     = jsondecode(module.controller.replica_discovery_policy).Statement[0].Condition.StringEquals["aws:RequestedRegion"] == ["ap-northeast-1", "eu-west-1", "us-east-1"]
    error_message = "in the AWS regions membership.aws polls, no other"
  }
  assert {
    condition     = alltrue([for w in [module.use1.replica_termination_wait_s, module.euw1.replica_termination_wait_s, module.apne1.replica_termination_wait_s] : w > 15 + 30])
    error_message = "a terminated replica waits longer than a poll plus the drain"
  }
}

run "no_replica_scaling_no_discovery" {
  command = plan
  variables {
    replica_scaling = { min_size = 0, desired_capacity = 0, max_size = 0 }
  }

  assert {
    condition     = !contains(keys(yamldecode(output.skymesh_config)), "membership")
    error_message = "a scaling pool that never launches is not polled"
  }
  assert {
    condition     = module.controller.replica_discovery_policy == null
    error_message = "and the controller role gets no Describe permissions"
  }
}
