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

variable "availability_zone" {
  description = "AZ for the subnet (GPU capacity differs per AZ)."
  type        = string
}

variable "ami_id" {
  description = "AMI with NVIDIA drivers (e.g. an AWS Deep Learning Base AMI) for replicas and balancer."
  type        = string
}

variable "replica_count" {
  description = "Number of GPU replicas running vLLM."
  type        = number
  default     = 2

  validation {
    condition     = var.replica_count >= 1 && var.replica_count <= 64
    error_message = "replica_count must be between 1 and 64."
  }
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

variable "balancer_private_ip" {
  description = "Fixed private IP of the balancer (the config module names it before apply); null: any."
  type        = string
  default     = null
}

variable "replica_private_ips" {
  description = "Fixed private IPs of the replicas, one per replica; empty: any."
  type        = list(string)
  default     = []

  validation {
    condition     = length(var.replica_private_ips) == 0 || length(var.replica_private_ips) == var.replica_count
    error_message = "replica_private_ips must be empty or list one IP per replica (replica_count)."
  }
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
