variable "name" {
  description = "Mesh region name, e.g. us-east-1."
  type        = string

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,62}$", var.name))
    error_message = "name must be a lowercase region name like eu-west-1."
  }
}

variable "vpc_cidr" {
  description = "CIDR of this region's VPC."
  type        = string
  default     = "10.10.0.0/16"

  validation {
    condition     = can(cidrhost(var.vpc_cidr, 0))
    error_message = "vpc_cidr must be a CIDR network."
  }
}

variable "availability_zones" {
  description = "AZs of the region's subnets, one subnet each (GPU capacity differs per AZ): the load balancers and both Auto Scaling groups span them; the first holds the static replicas."
  type        = list(string)

  validation {
    condition     = length(var.availability_zones) >= 1 && length(var.availability_zones) <= 6 && length(distinct(var.availability_zones)) == length(var.availability_zones)
    error_message = "availability_zones must list 1 to 6 distinct zones."
  }
}

variable "ami_id" {
  description = "AMI with NVIDIA drivers (e.g. an AWS Deep Learning Base AMI) for replicas and balancer."
  type        = string
}

variable "replica_scaling" {
  description = "The scaling pool of replicas (an Auto Scaling group): its bounds, its first size, the target of its tracking policy, in predicted seconds of prefill work waiting per healthy replica (the balancers' autoscaling signal), and how long a terminated instance waits to drain (termination_wait_s)."
  type = object({
    min_size                 = optional(number, 0)
    max_size                 = optional(number, 8)
    desired_capacity         = optional(number, 0)
    target_pending_prefill_s = optional(number, 2)
    # seconds an instance the group terminates waits (a termination lifecycle hook) out of
    # service before it stops: longer than the controller's membership.aws poll interval
    # plus membership.drain_grace_s, so it is seen gone and drained first
    termination_wait_s = optional(number, 60)
  })
  default = {}

  validation {
    condition     = var.replica_scaling.min_size >= 0 && var.replica_scaling.min_size <= var.replica_scaling.desired_capacity && var.replica_scaling.desired_capacity <= var.replica_scaling.max_size && var.replica_scaling.max_size <= 64
    error_message = "replica_scaling needs 0 <= min_size <= desired_capacity <= max_size <= 64."
  }
  validation {
    condition     = var.replica_scaling.target_pending_prefill_s > 0
    error_message = "replica_scaling.target_pending_prefill_s must be positive."
  }
  validation {
    condition     = var.replica_scaling.termination_wait_s >= 30 && var.replica_scaling.termination_wait_s <= 7200 && floor(var.replica_scaling.termination_wait_s) == var.replica_scaling.termination_wait_s
    error_message = "replica_scaling.termination_wait_s must be whole seconds between 30 and 7200 (a lifecycle hook's heartbeat timeout)."
  }
}

variable "balancer_scaling" {
  description = "The region's active-active balancers (an Auto Scaling group behind the load balancers): bounds and size."
  type = object({
    min_size         = optional(number, 2)
    max_size         = optional(number, 4)
    desired_capacity = optional(number, 2)
  })
  default = {}

  validation {
    condition     = var.balancer_scaling.min_size >= 1 && var.balancer_scaling.min_size <= var.balancer_scaling.desired_capacity && var.balancer_scaling.desired_capacity <= var.balancer_scaling.max_size && var.balancer_scaling.max_size <= 16
    error_message = "balancer_scaling needs 1 <= min_size <= desired_capacity <= max_size <= 16."
  }
}

variable "autoscaling_metric" {
  description = "The CloudWatch metric the balancers publish (the config's autoscaling.cloudwatch) and the replicas' policy tracks; its one dimension is Region = name."
  type = object({
    namespace = optional(string, "SkyMesh")
    name      = optional(string, "PendingPrefillSecondsPerReplica")
  })
  default = {}
}

variable "ports" {
  description = "The balancer's listeners (the config module's balancer_port, grpc_port, peer_port): HTTP (OpenAI API, /health), gRPC heartbeats, mTLS forwards from peers."
  type = object({
    http = optional(number, 8000)
    grpc = optional(number, 9000)
    peer = optional(number, 8443)
  })
  default = {}
}

variable "replica_instance_type" {
  description = "GPU instance type (g6.xlarge = 1x L4)."
  type        = string
  default     = "g6.xlarge"
}

variable "balancer_instance_type" {
  description = "Instance type of the balancer."
  type        = string
  default     = "c7i.large"
}

variable "model" {
  description = "Model vLLM serves (Hugging Face id or a local path baked into the AMI)."
  type        = string
  default     = "meta-llama/Llama-3.1-8B-Instruct"
}

variable "vllm_version" {
  description = "vLLM release installed on replicas."
  type        = string
  default     = "0.11.0"
}

variable "skymesh_package" {
  description = "pip requirement for skymesh on the balancer (a version or a wheel URL)."
  type        = string
  default     = "skymesh==0.1.0"
}

variable "client_cidrs" {
  description = "Networks allowed to reach the balancer's OpenAI API (port 8000)."
  type        = list(string)
  default     = ["0.0.0.0/0"]
}

variable "peer_cidrs" {
  description = "Networks of peer balancers and the controller (gRPC 9000, mTLS forwards 8443, /health on 8000)."
  type        = list(string)
}


variable "skymesh_config" {
  description = "The skymesh YAML (from the config module) written to the balancer."
  type        = string
  sensitive   = true
}

variable "replica_private_ips" {
  description = "The static pool: fixed private IPs (in the first subnet) of replicas the config names; empty: the scaling pool only."
  type        = list(string)
  default     = []
}

variable "credentials" {
  description = "The balancer's mesh credentials in Secrets Manager: the secrets module's balancers[<region>] (the ARNs its role may read, the optional KMS key, the fetch script systemd runs before every start)."
  type = object({
    secret_arns  = list(string)
    kms_key_arn  = optional(string)
    fetch_script = string
  })

  validation {
    condition     = length(var.credentials.secret_arns) > 0 && alltrue([for a in var.credentials.secret_arns : a != "*" && !strcontains(a, "*")])
    error_message = "credentials.secret_arns must name the secrets exactly (no wildcards)."
  }
}

variable "credentials_dir" {
  description = "Where the fetch script writes the files (the secrets module's host_dir); the peer token's environment file is peer-token.env there."
  type        = string
  default     = "/etc/skymesh/pki"
}
