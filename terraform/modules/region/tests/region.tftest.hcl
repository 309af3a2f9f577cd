# ids and ARNs in the shapes the provider checks (the mock's random strings are not)
mock_provider "aws" {
  mock_resource "aws_launch_template" {
    defaults = { id = "lt-0123456789abcdef0", latest_version = 1 }
  }
  mock_resource "aws_iam_instance_profile" {
    defaults = { arn = "arn:aws:iam::123456789012:instance-profile/skymesh-eu-west-1-balancer" }
  }
  mock_resource "aws_lb" {
    defaults = { arn = "arn:aws:elasticloadbalancing:eu-west-1:123456789012:loadbalancer/net/skymesh/0123456789abcdef" }
  }
  mock_resource "aws_lb_target_group" {
    defaults = { arn = "arn:aws:elasticloadbalancing:eu-west-1:123456789012:targetgroup/skymesh/0123456789abcdef" }
  }
}

# a distinct ARN per target group, so the group's registrations can be counted
override_resource {
  target = aws_lb_target_group.balancer["entry_http"]
  values = { arn = "arn:aws:elasticloadbalancing:eu-west-1:123456789012:targetgroup/skymesh-entry-http/0000000000000001" }
}
override_resource {
  target = aws_lb_target_group.balancer["mesh_http"]
  values = { arn = "arn:aws:elasticloadbalancing:eu-west-1:123456789012:targetgroup/skymesh-mesh-http/0000000000000002" }
}
override_resource {
  target = aws_lb_target_group.balancer["mesh_grpc"]
  values = { arn = "arn:aws:elasticloadbalancing:eu-west-1:123456789012:targetgroup/skymesh-mesh-grpc/0000000000000003" }
}
override_resource {
  target = aws_lb_target_group.balancer["mesh_peer"]
  values = { arn = "arn:aws:elasticloadbalancing:eu-west-1:123456789012:targetgroup/skymesh-mesh-peer/0000000000000004" }
}

variables {
  name                = "eu-west-1"
  availability_zones  = ["eu-west-1a", "eu-west-1b"]
  ami_id              = "ami-0123456789abcdef0"
  replica_private_ips = ["10.10.0.20", "10.10.0.21", "10.10.0.22"]
  peer_cidrs          = ["10.10.0.0/16", "10.30.0.0/16"]
  skymesh_config      = "model: x"
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
  # apply against the mock provider (nothing real): ids are unknown in a plan
  command = apply

  assert {
    condition     = length(aws_instance.replica) == 3 && tolist([for i in aws_instance.replica : i.private_ip]) == var.replica_private_ips
    error_message = "one static replica per fixed private IP"
  }
  assert {
    condition = (alltrue([for i in aws_instance.replica : i.metadata_options[0].http_tokens == "required"])
    && alltrue([for t in [aws_launch_template.balancer, aws_launch_template.replica] : t.metadata_options[0].http_tokens == "required" && t.metadata_options[0].http_put_response_hop_limit == 1]))
    error_message = "IMDSv2 only, on the static replicas and on every instance either Auto Scaling group launches"
  }
  assert {
    condition = (alltrue([for i in aws_instance.replica : i.root_block_device[0].encrypted])
    && alltrue([for t in [aws_launch_template.balancer, aws_launch_template.replica] : t.block_device_mappings[0].ebs[0].encrypted == "true"]))
    error_message = "encrypted root volumes"
  }
  assert {
    condition     = strcontains(aws_instance.replica[0].user_data, "--enable-prefix-caching") && strcontains(base64decode(aws_launch_template.replica.user_data), "--enable-prefix-caching")
    error_message = "vLLM must run with prefix caching, in both pools"
  }
  assert {
    condition     = strcontains(base64decode(aws_launch_template.balancer.user_data), "skymesh balancer --config /etc/skymesh/mesh.yaml --region eu-west-1")
    error_message = "the balancer runs skymesh balancer for its region"
  }
  assert {
    condition     = strcontains(base64decode(aws_launch_template.balancer.user_data), "ExecReload=/bin/kill -HUP $MAINPID")
    error_message = "systemctl reload skymesh-balancer sends SIGHUP (a config reload)"
  }
  assert {
    condition     = strcontains(base64decode(aws_launch_template.balancer.user_data), "--drain-listen-s 25 --drain-timeout-s 30") && strcontains(base64decode(aws_launch_template.balancer.user_data), "TimeoutStopSec=65")
    error_message = "a draining balancer serves while the target groups' checks (2 x 10 s) take it out, then drains (30 s); systemd gives it both before SIGKILL"
  }
}

run "a_fleet_of_balancers_across_zones" {
  # apply against the mock provider (nothing real): ids are unknown in a plan
  command = apply

  assert {
    condition     = length(aws_subnet.this) == 2 && tolist([for s in aws_subnet.this : s.availability_zone]) == var.availability_zones && length(aws_route_table_association.this) == 2
    error_message = "one routed subnet per availability zone"
  }
  assert {
    condition = (aws_autoscaling_group.balancer.desired_capacity == 2 && aws_autoscaling_group.balancer.min_size == 2
    && aws_autoscaling_group.balancer.health_check_type == "ELB")
    error_message = "two active-active balancers by default, replaced when the load balancers find them unhealthy"
  }
  assert {
    condition     = aws_autoscaling_group.balancer.launch_template[0].version == tostring(aws_launch_template.balancer.latest_version) && aws_autoscaling_group.balancer.instance_refresh[0].strategy == "Rolling"
    error_message = "a new balancer template rolls through the fleet"
  }
  assert {
    condition     = length(aws_lb_listener.balancer) == 4 && alltrue([for l in aws_lb_listener.balancer : l.protocol == "TCP"])
    error_message = "TCP listeners: the client port on the entry, HTTP, gRPC and peer ports on the mesh load balancer"
  }
  assert {
    condition = ({ for k, l in aws_lb_listener.balancer : k => l.port } == { entry_http = 8000, mesh_http = 8000, mesh_grpc = 9000, mesh_peer = 8443 }
    && { for k, tg in aws_lb_target_group.balancer : k => tg.port } == { entry_http = 8000, mesh_http = 8000, mesh_grpc = 9000, mesh_peer = 8443 })
    error_message = "each listener forwards to the balancers' port of the same name"
  }
  assert {
    condition = alltrue([for tg in aws_lb_target_group.balancer : tg.health_check[0].protocol == "HTTP" && tg.health_check[0].path == "/health"
    && tg.health_check[0].port == "8000" && tg.preserve_client_ip == "true" && tg.deregistration_delay == "45"])
    error_message = "every target group checks the balancer's /health, keeps client addresses and waits out the drain"
  }
  assert {
    condition = (aws_lb.entry.load_balancer_type == "network" && !aws_lb.entry.internal && aws_lb.entry.enable_cross_zone_load_balancing
    && aws_lb.mesh.load_balancer_type == "network" && aws_lb.mesh.internal && aws_lb.mesh.enable_cross_zone_load_balancing)
    error_message = "an internet-facing entry and an internal mesh network load balancer, both cross-zone"
  }
  assert {
    condition     = length(aws_lb.mesh.subnet_mapping) == 2 && toset([for m in aws_lb.mesh.subnet_mapping : m.private_ipv4_address]) == toset(["10.10.0.10", "10.10.1.10"])
    error_message = "the mesh load balancer sits at fixed private IPs, one per subnet"
  }
  assert {
    condition     = output.balancer_private_ip == "10.10.0.10" && output.balancer_private_ips == ["10.10.0.10", "10.10.1.10"]
    error_message = "the region's advertised private address is the mesh load balancer's, known at plan"
  }
  assert {
    condition     = length(aws_lb.entry.subnet_mapping) == 2 && length(aws_eip.entry) == 2 && alltrue([for e in aws_eip.entry : e.domain == "vpc"])
    error_message = "the entry load balancer holds one Elastic IP per subnet"
  }
}

run "entry_addresses_are_the_elastic_ips" {
  command = apply

  assert {
    condition     = toset([for m in aws_lb.entry.subnet_mapping : m.allocation_id]) == toset(aws_eip.entry[*].id)
    error_message = "the entry load balancer's addresses are the Elastic IPs"
  }
  assert {
    condition     = output.balancer_public_ip == aws_eip.entry[0].public_ip && output.balancer_public_ips == aws_eip.entry[*].public_ip
    error_message = "DNS publishes the entry's first Elastic IP"
  }
  assert {
    condition     = length(aws_autoscaling_group.balancer.target_group_arns) == 4 && toset(aws_autoscaling_group.balancer.target_group_arns) == toset([for tg in aws_lb_target_group.balancer : tg.arn])
    error_message = "every balancer registers behind all four listeners"
  }
}

run "replicas_scale_on_the_balancers_signal" {
  # apply against the mock provider (nothing real): ids are unknown in a plan
  command = apply
  variables {
    replica_scaling = { min_size = 1, max_size = 12, desired_capacity = 1, target_pending_prefill_s = 1.5 }
  }

  assert {
    # desired_capacity is the policy's once the group exists (ignore_changes): the first
    # run created it at the default, 0
    condition     = aws_autoscaling_group.replica.min_size == 1 && aws_autoscaling_group.replica.max_size == 12 && aws_autoscaling_group.replica.desired_capacity == 0
    error_message = "the scaling pool's bounds come from replica_scaling, its size from the policy"
  }
  assert {
    condition     = aws_autoscaling_policy.replica_pending_prefill.policy_type == "TargetTrackingScaling" && aws_autoscaling_policy.replica_pending_prefill.target_tracking_configuration[0].target_value == 1.5
    error_message = "a target tracking policy at the target value"
  }
  assert {
    condition = (aws_autoscaling_policy.replica_pending_prefill.target_tracking_configuration[0].customized_metric_specification[0].namespace == "SkyMesh"
      && aws_autoscaling_policy.replica_pending_prefill.target_tracking_configuration[0].customized_metric_specification[0].metric_name == "PendingPrefillSecondsPerReplica"
    && aws_autoscaling_policy.replica_pending_prefill.target_tracking_configuration[0].customized_metric_specification[0].statistic == "Average")
    error_message = "it tracks the balancers' SkyMesh/PendingPrefillSecondsPerReplica"
  }
  assert {
    condition = (tolist(aws_autoscaling_policy.replica_pending_prefill.target_tracking_configuration[0].customized_metric_specification[0].metric_dimension)
    == tolist([{ name = "Region", value = "eu-west-1" }]))
    error_message = "of this region only"
  }
  assert {
    condition     = { for t in aws_autoscaling_group.replica.tag : t.key => t.value if t.propagate_at_launch } == { "skymesh:role" = "replica", "skymesh:region" = "eu-west-1" }
    error_message = "the scaling pool's instances carry the tags a cloud membership source finds them by"
  }
}

run "balancers_may_publish_only_the_signal" {
  # apply against the mock provider (nothing real): ids are unknown in a plan
  command = apply

  assert {
    condition = (jsondecode(aws_iam_role_policy.balancer_metrics.policy).Statement[0].Action == ["cloudwatch:PutMetricData"]
    && jsondecode(aws_iam_role_policy.balancer_metrics.policy).Statement[0].Condition.StringEquals["cloudwatch:namespace"] == "SkyMesh")
    error_message = "PutMetricData in the SkyMesh namespace and nothing else"
  }
  assert {
    condition     = length(jsondecode(aws_iam_role_policy.balancer_metrics.policy).Statement) == 1 && aws_iam_role_policy.balancer_metrics.role == aws_iam_role.balancer.id
    error_message = "one statement, on the balancer role"
  }
}

run "rejects_a_balancer_fleet_out_of_bounds" {
  command = plan
  variables {
    balancer_scaling = { min_size = 3, desired_capacity = 2, max_size = 4 }
  }
  expect_failures = [var.balancer_scaling]
}

run "rejects_repeated_zones" {
  command = plan
  variables {
    availability_zones = ["eu-west-1a", "eu-west-1a"]
  }
  expect_failures = [var.availability_zones]
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
    condition     = length([for r in aws_security_group.balancer.ingress : r if r.from_port == 8000 && toset(r.cidr_blocks) == toset(["10.10.0.0/16"])]) == 1
    error_message = "the load balancers' health checks (from their nodes in this VPC) reach /health"
  }
  assert {
    condition     = alltrue([for r in aws_security_group.balancer.ingress : r.from_port == 8000 && r.to_port == 8000 if toset(r.cidr_blocks) == toset(["10.10.0.0/16"])])
    error_message = "the VPC-wide rule opens the health check port only"
  }

  assert {
    condition     = length([for r in aws_security_group.balancer.ingress : r if r.from_port == 8443 && r.to_port == 8443 && toset(r.cidr_blocks) == toset(var.peer_cidrs)]) == 1
    error_message = "the peer listener (8443, mTLS forwards) is open to peer networks only"
  }

  assert {
    condition     = length([for r in aws_security_group.balancer.ingress : r if r.from_port == 9000 && r.to_port == 9000 && coalesce(r.self, false) && length(coalesce(r.cidr_blocks, [])) == 0]) == 1
    error_message = "the region's balancers reach each other's gRPC listener (the sibling channel) through the security group itself"
  }
}

run "rejects_a_replica_pool_out_of_bounds" {
  command = plan
  variables {
    replica_scaling = { min_size = 0, desired_capacity = 3, max_size = 2 }
  }
  expect_failures = [var.replica_scaling]
}

run "balancer_role_reads_only_its_credentials" {
  # apply against the mock provider (nothing real): ids are unknown in a plan
  command = apply

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
    condition     = aws_launch_template.balancer.iam_instance_profile[0].arn == aws_iam_instance_profile.balancer.arn
    error_message = "every balancer the group launches gets the role"
  }
}

run "balancer_fetches_credentials_before_every_start" {
  command = plan

  assert {
    condition     = strcontains(base64decode(aws_launch_template.balancer.user_data), "content: ${base64encode(var.credentials.fetch_script)}") && strcontains(base64decode(aws_launch_template.balancer.user_data), "path: /usr/local/sbin/skymesh-fetch-credentials")
    error_message = "the fetch script is written to the instance"
  }
  assert {
    condition     = strcontains(base64decode(aws_launch_template.balancer.user_data), "ExecStartPre=/usr/local/sbin/skymesh-fetch-credentials") && strcontains(base64decode(aws_launch_template.balancer.user_data), "EnvironmentFile=-/etc/skymesh/pki/peer-token.env")
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

run "replica_group_name_is_known_at_plan" {
  command = plan

  assert {
    condition     = output.replica_asg_name == "skymesh-eu-west-1-replica"
    error_message = "the config names the replica group before apply: its name is fixed"
  }
}

run "scale_in_waits_for_the_drain" {
  command = plan
  variables {
    replica_scaling = { termination_wait_s = 90 }
  }

  assert {
    condition = (aws_autoscaling_lifecycle_hook.replica_drain.autoscaling_group_name == "skymesh-eu-west-1-replica"
      && aws_autoscaling_lifecycle_hook.replica_drain.lifecycle_transition == "autoscaling:EC2_INSTANCE_TERMINATING"
    && aws_autoscaling_lifecycle_hook.replica_drain.default_result == "CONTINUE")
    error_message = "a termination hook on the replica group that lets the instance go by itself"
  }
  assert {
    condition     = aws_autoscaling_lifecycle_hook.replica_drain.heartbeat_timeout == 90 && output.replica_termination_wait_s == 90
    error_message = "the instance waits replica_scaling.termination_wait_s before it stops"
  }
}

run "rejects_a_termination_wait_aws_refuses" {
  command = plan
  variables {
    replica_scaling = { termination_wait_s = 10 }
  }
  expect_failures = [var.replica_scaling]
}
