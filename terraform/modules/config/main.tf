# Provider-free: turns the variables into the skymesh YAML config (the format skymesh/config/
# reads), so `terraform output -raw skymesh_config > mesh.yaml` feeds `skymesh` directly.
terraform {
  required_version = ">= 1.6"
}

locals {
  dir = trimsuffix(coalesce(var.credentials_dir, "/unset"), "/")
  # the file names of `skymesh pki issue` (skymesh/security/pki_cli.py), which the fetch scripts of the
  # secrets module keep; each host holds only its own pair, and reads only that one
  credentials = { for k, v in {
    tls = {
      ca_cert    = "${local.dir}/ca.crt"
      controller = { cert = "${local.dir}/controller.crt", key = "${local.dir}/controller.key" }
      balancers = { for r in var.regions : r.name => {
        cert = "${local.dir}/balancer-${r.name}.crt"
        key  = "${local.dir}/balancer-${r.name}.key"
      } }
    }
    admin = { token_file = "${local.dir}/admin-token" }
  } : k => v if var.credentials_dir != null }
  autoscaling = var.autoscaling == null ? {} : {
    autoscaling = { cloudwatch = {
      namespace   = var.autoscaling.namespace
      metric_name = var.autoscaling.metric_name
      interval_s  = var.autoscaling.interval_s
    } }
  }
  # membership.aws: per AWS region (a region's aws_region, default its name), the replica
  # Auto Scaling groups of the mesh regions there, each group's replicas in its region
  asg_aws_regions = sort(distinct([for r in var.regions : coalesce(r.aws_region, r.name) if length(r.replica_asg_names) > 0]))
  membership = length(local.asg_aws_regions) == 0 ? {} : {
    membership = {
      drain_grace_s = var.replica_discovery.drain_grace_s
      aws = [for aws_region in local.asg_aws_regions : {
        aws_region      = aws_region
        port            = var.replica_discovery.port
        scheme          = var.replica_discovery.scheme
        poll_interval_s = var.replica_discovery.poll_interval_s
        auto_scaling_groups = flatten([for r in var.regions : [
          for n in r.replica_asg_names : { name = n, region = r.name }
        ] if coalesce(r.aws_region, r.name) == aws_region])
      }]
    }
  }
  config = merge({
    model = var.model
    regions = [for r in var.regions : merge(
      {
        name            = r.name
        source_networks = r.source_networks
        balancer = merge(
          {
            listen         = "0.0.0.0:${r.balancer_port}"
            grpc_listen    = "0.0.0.0:${r.grpc_port}"
            advertise      = "${r.balancer_private_ip}:${r.balancer_port}"
            grpc_advertise = "${r.balancer_private_ip}:${r.grpc_port}"
            peer_listen    = "0.0.0.0:${r.peer_port}"
            peer_advertise = "${r.balancer_private_ip}:${r.peer_port}"
            # the region's balancers are an Auto Scaling group: the config lists none, each
            # registers itself under its EC2 instance id at its private IPv4 (IMDSv2), and
            # finds its siblings in the controller's topology
            fleet = "registered"
          },
          r.balancer_public_ip == null ? {} : { public_ip = r.balancer_public_ip },
          # the controller deregisters a dead balancer from these (and registers it again)
          length(r.entry_target_group_arns) == 0 ? {} : { entry_target_groups = distinct(r.entry_target_group_arns) },
        )
        replicas = [for i, ip in r.replica_ips : {
          id  = "${r.name}-gpu${i}"
          url = "http://${ip}:${r.replica_port}"
        }]
      },
      { aws_region = coalesce(r.aws_region, r.name) },
    )]
    latencies        = var.latencies
    local_latency_ms = 1
    emulate_latency  = false
    controller = {
      listen           = "${var.controller_ip}:7001"
      http_listen      = "${var.controller_ip}:7002"
      state_path       = "/var/lib/skymesh/controller.sqlite"
      probe_interval_s = 2.0
    }
    dns = {
      name        = var.dns_name
      provider    = "route53"
      hosted_zone = var.hosted_zone
      ttl_s       = 30
    }
    policy = {
      name        = var.policy.name
      ttft_slo_s  = var.policy.ttft_slo_s
      queue_bound = var.policy.queue_bound
    }
    offload = {
      enabled = true
      rules   = var.offload_rules
    }
  }, var.peer_token == null ? {} : { peer_token = var.peer_token }, local.credentials, local.autoscaling, local.membership)
}
