# Three regions, one controller, Route53 latency records. Provider aliases per region.
terraform {
  required_version = ">= 1.11" # the secrets module's write-only arguments
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.0, < 6.0"
    }
  }
}

provider "aws" {
  alias  = "use1"
  region = "us-east-1"
}

provider "aws" {
  alias  = "euw1"
  region = "eu-west-1"
}

provider "aws" {
  alias  = "apne1"
  region = "ap-northeast-1"
}

locals {
  regions = {
    "us-east-1"      = { cidr = "10.10.0.0/16", azs = ["us-east-1a", "us-east-1b"], ami = var.amis["us-east-1"] }
    "eu-west-1"      = { cidr = "10.20.0.0/16", azs = ["eu-west-1a", "eu-west-1b"], ami = var.amis["eu-west-1"] }
    "ap-northeast-1" = { cidr = "10.30.0.0/16", azs = ["ap-northeast-1a", "ap-northeast-1c"], ami = var.amis["ap-northeast-1"] }
  }
  all_cidrs     = [for r in local.regions : r.cidr]
  controller_ip = cidrhost(cidrsubnet(local.regions["us-east-1"].cidr, 8, 0), 5)
  # the static pool of replicas, at fixed addresses in each region's first subnet
  replica_ips = { for k, r in local.regions : k => [for i in range(var.replicas_per_region) : cidrhost(cidrsubnet(r.cidr, 8, 0), 20 + i)] }
  # a region's address for peers and the controller: its internal (mesh) load balancer's
  # fixed private IP in the first subnet, computed from the CIDR (known at plan)
  balancer_ip = {
    "us-east-1"      = module.use1.balancer_private_ip
    "eu-west-1"      = module.euw1.balancer_private_ip
    "ap-northeast-1" = module.apne1.balancer_private_ip
  }
  balancer_public_ip = {
    "us-east-1"      = module.use1.balancer_public_ip
    "eu-west-1"      = module.euw1.balancer_public_ip
    "ap-northeast-1" = module.apne1.balancer_public_ip
  }
  latencies = [
    { regions = ["us-east-1", "eu-west-1"], one_way_ms = 38 },
    { regions = ["us-east-1", "ap-northeast-1"], one_way_ms = 80 },
    { regions = ["eu-west-1", "ap-northeast-1"], one_way_ms = 110 },
  ]
}

# The mesh's credentials, issued offline by `skymesh pki issue` into var.credentials_dir,
# one Secrets Manager secret per component in us-east-1. Each instance role may read only
# its own (a balancer: the CA certificate, the peer token, its pair; the controller: the
# CA certificate, the admin token, its pair); systemd fetches them before every start.
locals {
  pki = trimsuffix(var.credentials_dir, "/")
}

module "secrets" {
  source     = "../../modules/secrets"
  providers  = { aws = aws.use1 }
  regions    = keys(local.regions)
  ca_cert    = file("${local.pki}/ca.crt")
  controller = { cert = file("${local.pki}/controller.crt"), key = file("${local.pki}/controller.key") }
  balancers = { for k in keys(local.regions) : k => {
    cert = file("${local.pki}/balancer-${k}.crt")
    key  = file("${local.pki}/balancer-${k}.key")
  } }
  peer_token  = file("${local.pki}/peer-token")
  admin_token = file("${local.pki}/admin-token")
  kms_key_arn = var.kms_key_arn
}

# The config is computed from planned addresses (each region's mesh load balancer at a
# fixed private IP, the entry load balancer's Elastic IP, which is allocated before any
# instance, the static replicas' fixed IPs), so every instance gets the same YAML at boot.
module "config" {
  source = "../../modules/config"
  model  = var.model
  regions = [for k, r in local.regions : {
    name                = k
    source_networks     = [r.cidr]
    balancer_private_ip = local.balancer_ip[k]
    balancer_public_ip  = local.balancer_public_ip[k]
    replica_ips         = local.replica_ips[k]
    # the controller lists the scaling pool's InService instances (membership.aws)
    replica_asg_names = local.replica_scaling_on ? [local.replica_asg_name[k]] : []
    # the controller takes a dead balancer out of its region's load balancers at once
    entry_target_group_arns = local.entry_target_group_arns[k]
  }]
  latencies     = local.latencies
  policy        = { name = var.policy }
  dns_name      = var.dns_name
  hosted_zone   = var.hosted_zone
  controller_ip = local.controller_ip
  # tls: and admin.token_file name the files the fetch scripts write; the peer token
  # reaches the balancers in their environment, so the config (user data) holds no secret
  credentials_dir = module.secrets.host_dir
  # every balancer publishes the autoscaling signal the replicas' scaling policy tracks
  autoscaling       = { namespace = local.autoscaling_metric.namespace, metric_name = local.autoscaling_metric.name }
  replica_discovery = local.replica_discovery
}

# The scaling pool of replicas is on when its group may launch any (max_size > 0): then the
# config names each region's group (a fixed name, known at plan), the controller polls
# them and may call the two read-only Describe APIs, and an instance the group terminates
# waits out the controller's poll and the drain before it stops.
locals {
  autoscaling_metric = { namespace = "SkyMesh", name = "PendingPrefillSecondsPerReplica" }
  replica_scaling_on = var.replica_scaling.max_size > 0
  replica_asg_name = {
    "us-east-1"      = module.use1.replica_asg_name
    "eu-west-1"      = module.euw1.replica_asg_name
    "ap-northeast-1" = module.apne1.replica_asg_name
  }
  replica_discovery = { port = 8000, scheme = "http", poll_interval_s = 15, drain_grace_s = 30 }
  replica_scaling = merge(var.replica_scaling, {
    termination_wait_s = local.replica_discovery.poll_interval_s + local.replica_discovery.drain_grace_s + 15
  })
}

module "use1" {
  source              = "../../modules/region"
  providers           = { aws = aws.use1 }
  name                = "us-east-1"
  vpc_cidr            = local.regions["us-east-1"].cidr
  availability_zones  = local.regions["us-east-1"].azs
  ami_id              = local.regions["us-east-1"].ami
  replica_private_ips = local.replica_ips["us-east-1"]
  replica_scaling     = local.replica_scaling
  balancer_scaling    = var.balancer_scaling
  autoscaling_metric  = local.autoscaling_metric
  peer_cidrs          = local.all_cidrs
  model               = var.model
  skymesh_package     = var.skymesh_package
  skymesh_config      = module.config.skymesh_config
  credentials         = module.secrets.balancers["us-east-1"]
  credentials_dir     = module.secrets.host_dir
}

module "euw1" {
  source              = "../../modules/region"
  providers           = { aws = aws.euw1 }
  name                = "eu-west-1"
  vpc_cidr            = local.regions["eu-west-1"].cidr
  availability_zones  = local.regions["eu-west-1"].azs
  ami_id              = local.regions["eu-west-1"].ami
  replica_private_ips = local.replica_ips["eu-west-1"]
  replica_scaling     = local.replica_scaling
  balancer_scaling    = var.balancer_scaling
  autoscaling_metric  = local.autoscaling_metric
  peer_cidrs          = local.all_cidrs
  model               = var.model
  skymesh_package     = var.skymesh_package
  skymesh_config      = module.config.skymesh_config
  credentials         = module.secrets.balancers["eu-west-1"]
  credentials_dir     = module.secrets.host_dir
}

module "apne1" {
  source              = "../../modules/region"
  providers           = { aws = aws.apne1 }
  name                = "ap-northeast-1"
  vpc_cidr            = local.regions["ap-northeast-1"].cidr
  availability_zones  = local.regions["ap-northeast-1"].azs
  ami_id              = local.regions["ap-northeast-1"].ami
  replica_private_ips = local.replica_ips["ap-northeast-1"]
  replica_scaling     = local.replica_scaling
  balancer_scaling    = var.balancer_scaling
  autoscaling_metric  = local.autoscaling_metric
  peer_cidrs          = local.all_cidrs
  model               = var.model
  skymesh_package     = var.skymesh_package
  skymesh_config      = module.config.skymesh_config
  credentials         = module.secrets.balancers["ap-northeast-1"]
  credentials_dir     = module.secrets.host_dir
}

module "dns" {
  source      = "../../modules/dns"
  providers   = { aws = aws.use1 }
  zone_name   = var.hosted_zone
  record_name = var.dns_name
  balancers   = { for k, ip in local.balancer_public_ip : k => { ip = ip } }
}

# The controller shares us-east-1's subnet at the address the config names; peering
# lets it probe every balancer and lets balancers reach each other (and adopted replicas)
# over private addresses.
module "controller" {
  source          = "../../modules/controller"
  providers       = { aws = aws.use1 }
  subnet_id       = module.use1.subnet_id
  vpc_id          = module.use1.vpc_id
  private_ip      = local.controller_ip
  ami_id          = local.regions["us-east-1"].ami
  hosted_zone_id  = module.dns.zone_id
  balancer_cidrs  = local.all_cidrs
  admin_cidrs     = var.admin_cidrs
  skymesh_package = var.skymesh_package
  skymesh_config  = module.config.skymesh_config
  credentials     = module.secrets.controller
  # membership.aws polls the replica groups: the read-only Describe calls, in the AWS
  # regions the config lists them in, nothing more (replicas do not register themselves,
  # so replica_cidrs stays empty)
  replica_discovery = local.replica_scaling_on
  # each mesh region is named after its AWS region (the config's aws_region default)
  replica_discovery_regions = local.replica_scaling_on ? keys(local.regions) : []
  # it moves dead balancers out of (and live ones back into) the regions' target groups
  entry_target_group_arns = flatten(values(local.entry_target_group_arns))
}

locals {
  entry_target_group_arns = {
    "us-east-1"      = module.use1.entry_target_group_arns
    "eu-west-1"      = module.euw1.entry_target_group_arns
    "ap-northeast-1" = module.apne1.entry_target_group_arns
  }
}

module "peer_use1_euw1" {
  source          = "../../modules/peering"
  providers       = { aws.requester = aws.use1, aws.accepter = aws.euw1 }
  name            = "us-east-1<->eu-west-1"
  requester       = { vpc_id = module.use1.vpc_id, cidr = local.regions["us-east-1"].cidr, route_table_id = module.use1.route_table_id }
  accepter        = { vpc_id = module.euw1.vpc_id, cidr = local.regions["eu-west-1"].cidr, route_table_id = module.euw1.route_table_id }
  accepter_region = "eu-west-1"
}

module "peer_use1_apne1" {
  source          = "../../modules/peering"
  providers       = { aws.requester = aws.use1, aws.accepter = aws.apne1 }
  name            = "us-east-1<->ap-northeast-1"
  requester       = { vpc_id = module.use1.vpc_id, cidr = local.regions["us-east-1"].cidr, route_table_id = module.use1.route_table_id }
  accepter        = { vpc_id = module.apne1.vpc_id, cidr = local.regions["ap-northeast-1"].cidr, route_table_id = module.apne1.route_table_id }
  accepter_region = "ap-northeast-1"
}

module "peer_euw1_apne1" {
  source          = "../../modules/peering"
  providers       = { aws.requester = aws.euw1, aws.accepter = aws.apne1 }
  name            = "eu-west-1<->ap-northeast-1"
  requester       = { vpc_id = module.euw1.vpc_id, cidr = local.regions["eu-west-1"].cidr, route_table_id = module.euw1.route_table_id }
  accepter        = { vpc_id = module.apne1.vpc_id, cidr = local.regions["ap-northeast-1"].cidr, route_table_id = module.apne1.route_table_id }
  accepter_region = "ap-northeast-1"
}
