variable "model" {
  description = "Model name the replicas serve (the OpenAI `model` field)."
  type        = string
  default     = "meta-llama/Llama-3.1-8B-Instruct"
}

variable "regions" {
  description = "Regions of the mesh: balancer addresses, replica addresses, client networks."
  type = list(object({
    name                = string
    aws_region          = optional(string)
    source_networks     = list(string)
    balancer_private_ip = string
    balancer_public_ip  = optional(string)
    replica_ips         = list(string)
    replica_port        = optional(number, 8000)
    # Auto Scaling groups whose InService instances are replicas of this region (the
    # region module's replica_asg_name): the controller lists them (membership.aws)
    replica_asg_names = optional(list(string), [])
    balancer_port     = optional(number, 8000)
    grpc_port         = optional(number, 9000)
    peer_port         = optional(number, 8443) # forwards from peer balancers (mTLS)
    # the target groups in front of the region's balancers (the region module's
    # entry_target_group_arns): the controller takes a dead balancer out of them at once
    entry_target_group_arns = optional(list(string), [])
  }))

  validation {
    condition     = length(var.regions) > 0
    error_message = "regions must list at least one region."
  }
  validation {
    condition     = alltrue([for r in var.regions : can(regex("^[a-z][a-z0-9-]{1,62}$", r.name))])
    error_message = "Every regions[].name must be a lowercase region name like eu-west-1."
  }
  validation {
    condition     = length(distinct([for r in var.regions : r.name])) == length(var.regions)
    error_message = "regions[].name values must be unique."
  }
  validation {
    condition     = alltrue([for r in var.regions : length(r.replica_ips) > 0 || length(r.replica_asg_names) > 0])
    error_message = "Every region needs replicas: regions[].replica_ips, or an Auto Scaling group of them in regions[].replica_asg_names."
  }
  validation {
    condition     = length(flatten(var.regions[*].replica_asg_names)) == length(distinct(flatten(var.regions[*].replica_asg_names)))
    error_message = "An Auto Scaling group's replicas belong to one region: regions[].replica_asg_names must not repeat a group."
  }
  validation {
    condition     = alltrue([for n in flatten(var.regions[*].replica_asg_names) : length(n) >= 1 && length(n) <= 255])
    error_message = "regions[].replica_asg_names must be Auto Scaling group names (1 to 255 characters)."
  }
  validation {
    condition = alltrue(flatten([for r in var.regions : [for a in r.entry_target_group_arns :
    can(regex("^arn:aws(-[a-z]+)*:elasticloadbalancing:${coalesce(r.aws_region, r.name)}:[0-9]{12}:targetgroup/[A-Za-z0-9-]{1,32}/[0-9a-f]{16}$", a))]]))
    error_message = "regions[].entry_target_group_arns must be target group ARNs in the region's AWS region (aws_region, default its name)."
  }
  validation {
    condition     = alltrue(flatten([for r in var.regions : [for n in r.source_networks : can(cidrhost(n, 0))]]))
    error_message = "regions[].source_networks must be CIDR networks like 10.1.0.0/16."
  }
}

variable "latencies" {
  description = "One-way latency in ms between every pair of regions."
  type = list(object({
    regions    = list(string)
    one_way_ms = number
  }))
  default = []

  validation {
    condition     = alltrue([for l in var.latencies : length(l.regions) == 2 && l.one_way_ms >= 0])
    error_message = "Each latencies[] entry needs two region names and a one_way_ms >= 0."
  }
}

variable "policy" {
  description = "Routing policy and SLO."
  type = object({
    name        = optional(string, "dualmap")
    ttft_slo_s  = optional(number, 2.0)
    queue_bound = optional(number, 4096)
  })
  default = {}

  validation {
    condition     = contains(["dualmap", "prefix_tree", "consistent_hash", "round_robin", "least_load", "cache_aware", "min_ttft", "preble"], var.policy.name)
    error_message = "policy.name must be one of dualmap, prefix_tree, consistent_hash, round_robin, least_load, cache_aware, min_ttft, preble."
  }
  validation {
    condition     = var.policy.ttft_slo_s > 0
    error_message = "policy.ttft_slo_s must be > 0 seconds."
  }
}

variable "offload_rules" {
  description = "GDPR-style offload restrictions: from a region glob to allowed target globs."
  type = list(object({
    from = string
    to   = list(string)
  }))
  default = [{ from = "eu-*", to = ["eu-*"] }]
}

variable "dns_name" {
  description = "The mesh name clients use, e.g. llm.example.com."
  type        = string

  validation {
    condition     = can(regex("^([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\\.)+[a-z][a-z0-9-]{0,61}[a-z0-9]$", var.dns_name))
    error_message = "dns_name must be a DNS name like llm.example.com."
  }
}

variable "hosted_zone" {
  description = "Route53 public hosted zone that holds dns_name."
  type        = string
}

variable "controller_ip" {
  description = "Private IP of the controller instance."
  type        = string

  validation {
    condition     = can(cidrhost("${var.controller_ip}/32", 0))
    error_message = "controller_ip must be an IPv4 address."
  }
}

variable "peer_token" {
  description = "Shared secret balancers present when forwarding to each other, written into the config. Leave null when the instances get it from the secrets module (SKYMESH_PEER_TOKEN in a root-only environment file): a value here lands in every instance's user data."
  type        = string
  default     = null
  sensitive   = true

  validation {
    condition     = var.peer_token == null || length(coalesce(var.peer_token, "-")) >= 16
    error_message = "peer_token must be at least 16 characters."
  }
}

variable "credentials_dir" {
  description = "Directory on the instances holding the mesh credentials (the secrets module's host_dir, e.g. /etc/skymesh/pki): the config's tls section names ca.crt, controller.{crt,key} and balancer-<region>.{crt,key} there, and admin.token_file its admin-token. null: no tls section (gRPC then only binds loopback)."
  type        = string
  default     = null

  validation {
    condition     = var.credentials_dir == null || can(regex("^/[A-Za-z0-9._/-]+$", coalesce(var.credentials_dir, "-")))
    error_message = "credentials_dir must be an absolute path of plain characters."
  }
}

variable "autoscaling" {
  description = "Where every balancer publishes the autoscaling signal (the config's autoscaling.cloudwatch: CloudWatch namespace, metric name, seconds between data points); null: not published."
  type = object({
    namespace   = optional(string, "SkyMesh")
    metric_name = optional(string, "PendingPrefillSecondsPerReplica")
    interval_s  = optional(number, 60)
  })
  default = null

  validation {
    condition     = var.autoscaling == null || try(var.autoscaling.interval_s >= 1 && var.autoscaling.interval_s <= 3600, false)
    error_message = "autoscaling.interval_s must be between 1 and 3600 seconds."
  }
}

variable "replica_discovery" {
  description = "How the controller lists the replicas of the Auto Scaling groups in regions[].replica_asg_names (the config's membership section, one membership.aws entry per AWS region): the replicas' vLLM port and scheme, seconds between polls, and how long a replica that leaves drains (membership.drain_grace_s). Rendered only when a region names a group."
  type = object({
    port            = optional(number, 8000)
    scheme          = optional(string, "http")
    poll_interval_s = optional(number, 15)
    drain_grace_s   = optional(number, 30)
  })
  default = {}

  validation {
    condition     = var.replica_discovery.port >= 1 && var.replica_discovery.port <= 65535 && floor(var.replica_discovery.port) == var.replica_discovery.port
    error_message = "replica_discovery.port must be a TCP port (1 to 65535)."
  }
  validation {
    condition     = contains(["http", "https"], var.replica_discovery.scheme)
    error_message = "replica_discovery.scheme must be http or https."
  }
  validation {
    condition     = var.replica_discovery.poll_interval_s >= 0.1 && var.replica_discovery.poll_interval_s <= 3600
    error_message = "replica_discovery.poll_interval_s must be between 0.1 and 3600 seconds."
  }
  validation {
    condition     = var.replica_discovery.drain_grace_s >= 0 && var.replica_discovery.drain_grace_s <= 3600
    error_message = "replica_discovery.drain_grace_s must be between 0 and 3600 seconds."
  }
}
