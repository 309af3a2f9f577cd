variable "amis" {
  description = "GPU-ready AMI per region (e.g. AWS Deep Learning Base AMI)."
  type        = map(string)
}

variable "replicas_per_region" {
  description = "vLLM replicas per region in the static pool (fixed addresses the config names)."
  type        = number
  default     = 2

  validation {
    condition     = var.replicas_per_region >= 1 && var.replicas_per_region <= 64
    error_message = "replicas_per_region must be between 1 and 64 (the config needs one replica per region)."
  }
}

variable "replica_scaling" {
  description = "Per region, the scaling pool of replicas (the region module's replica_scaling): bounds, first size, target seconds of pending prefill per replica."
  type = object({
    min_size                 = optional(number, 0)
    max_size                 = optional(number, 8)
    desired_capacity         = optional(number, 0)
    target_pending_prefill_s = optional(number, 2)
  })
  default = {}
}

variable "balancer_scaling" {
  description = "Per region, the active-active balancers behind the load balancers (the region module's balancer_scaling)."
  type = object({
    min_size         = optional(number, 2)
    max_size         = optional(number, 4)
    desired_capacity = optional(number, 2)
  })
  default = {}
}

variable "model" {
  description = "Model all replicas serve."
  type        = string
  default     = "meta-llama/Llama-3.1-8B-Instruct"
}

variable "policy" {
  description = "Routing policy."
  type        = string
  default     = "dualmap"
}

variable "dns_name" {
  description = "The mesh name."
  type        = string
}

variable "hosted_zone" {
  description = "Existing public hosted zone holding dns_name."
  type        = string
}

variable "credentials_dir" {
  description = "Directory (on the machine running terraform) written by `skymesh pki issue --config mesh.yaml --out DIR`: ca.crt, controller.{crt,key}, balancer-<region>.{crt,key}, peer-token, admin-token. Their values go to Secrets Manager (write-only: not in the plan or the state); ca.key is never read."
  type        = string
}

variable "kms_key_arn" {
  description = "Customer-managed KMS key (in us-east-1) for the secrets; null: the AWS managed key aws/secretsmanager."
  type        = string
  default     = null
}

variable "admin_cidrs" {
  description = "Who may read the controller's status API."
  type        = list(string)
  default     = []
}

variable "skymesh_package" {
  description = "pip requirement the balancers and the controller install skymesh from: a wheel URL, `skymesh @ git+https://...@<tag>` or a version on your package index."
  type        = string

  validation {
    condition     = length(trimspace(var.skymesh_package)) > 0
    error_message = "skymesh_package must name where pip installs skymesh from."
  }
}
