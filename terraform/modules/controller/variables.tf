variable "name" {
  description = "Name prefix."
  type        = string
  default     = "skymesh-controller"
}

variable "subnet_id" {
  description = "Subnet of the controller instance."
  type        = string
}

variable "vpc_id" {
  description = "VPC of the controller instance."
  type        = string
}

variable "private_ip" {
  description = "Fixed private IP (the config module names the controller's address before apply); null: any."
  type        = string
  default     = null

  validation {
    condition     = var.private_ip == null || can(cidrhost("${coalesce(var.private_ip, "0.0.0.0")}/32", 0))
    error_message = "private_ip must be an IPv4 address."
  }
}

variable "associate_public_ip" {
  description = "Give the instance a public IP for outbound calls (Route53 API, package index) when the subnet has no NAT gateway."
  type        = bool
  default     = true
}

variable "ami_id" {
  description = "AMI for the controller."
  type        = string
}

variable "instance_type" {
  description = "Controller instance type."
  type        = string
  default     = "t3.small"
}

variable "hosted_zone_id" {
  description = "Route53 zone the controller may change (and nothing else)."
  type        = string

  validation {
    condition     = can(regex("^Z[A-Z0-9]+$", var.hosted_zone_id))
    error_message = "hosted_zone_id must be a Route53 zone id like Z0123456789ABC."
  }
}

variable "balancer_cidrs" {
  description = "Networks of the regional balancers (they register and report over gRPC 7001)."
  type        = list(string)
}

variable "replica_cidrs" {
  description = "Networks of replicas that register themselves with the controller (membership.registration: the API on 7002, under its own token); empty: closed."
  type        = list(string)
  default     = []
}

variable "replica_discovery" {
  description = "Let the controller list Auto Scaling groups and EC2 instances (membership.aws: read-only DescribeAutoScalingGroups and DescribeInstances)."
  type        = bool
  default     = false
}

variable "replica_discovery_regions" {
  description = "AWS regions the controller may list replicas in (the config's membership.aws[].aws_region): the discovery policy's aws:RequestedRegion condition; empty: any region."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for r in var.replica_discovery_regions : can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]+$", r))])
    error_message = "replica_discovery_regions must be AWS region names like eu-west-1."
  }
}

variable "entry_target_group_arns" {
  description = "Target groups in front of the regions' balancers (the config's balancer.entry_target_groups): the controller may deregister a dead balancer from them and register it again (elasticloadbalancing:DeregisterTargets, RegisterTargets on these groups only); empty: none."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for a in var.entry_target_group_arns : can(regex("^arn:aws(-[a-z]+)*:elasticloadbalancing:[a-z0-9-]+:[0-9]{12}:targetgroup/[A-Za-z0-9-]{1,32}/[0-9a-f]{16}$", a))])
    error_message = "entry_target_group_arns must be target group ARNs (no wildcards)."
  }
}

variable "admin_cidrs" {
  description = "Networks allowed to read the status API (7002) for `skymesh status`."
  type        = list(string)
  default     = []
}

variable "skymesh_package" {
  description = "pip requirement for skymesh."
  type        = string
  default     = "skymesh==0.1.0"
}

variable "skymesh_config" {
  description = "The skymesh YAML (from the config module)."
  type        = string
  sensitive   = true
}

variable "credentials" {
  description = "The controller's mesh credentials in Secrets Manager: the secrets module's controller output (the ARNs its role may read, the optional KMS key, the fetch script systemd runs before every start)."
  type = object({
    secret_arns  = list(string)
    kms_key_arn  = optional(string)
    fetch_script = string
  })

  validation {
    condition     = length(var.credentials.secret_arns) > 0 && alltrue([for a in var.credentials.secret_arns : !strcontains(a, "*")])
    error_message = "credentials.secret_arns must name the secrets exactly (no wildcards)."
  }
}
