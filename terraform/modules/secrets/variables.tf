variable "name_prefix" {
  description = "Prefix of every secret's name: <prefix>/ca-cert, <prefix>/peer-token, <prefix>/admin-token, <prefix>/controller, <prefix>/balancer/<region>."
  type        = string
  default     = "skymesh"

  validation {
    condition     = can(regex("^[A-Za-z0-9_+=.@-]+(/[A-Za-z0-9_+=.@-]+)*$", var.name_prefix))
    error_message = "name_prefix may hold letters, digits, /_+=.@- and no empty path segment."
  }
}

variable "regions" {
  description = "The mesh's region names (one balancer secret each); must match the keys of balancers."
  type        = list(string)

  validation {
    condition     = length(var.regions) > 0 && alltrue([for r in var.regions : can(regex("^[a-z][a-z0-9-]{1,62}$", r))])
    error_message = "regions must list lowercase region names like eu-west-1."
  }
}

variable "ca_cert" {
  description = "The mesh CA certificate (PEM, ca.crt of `skymesh pki issue`). Never the CA key."
  type        = string
  sensitive   = true

  validation {
    condition     = strcontains(var.ca_cert, "-----BEGIN CERTIFICATE-----") && !strcontains(var.ca_cert, "PRIVATE KEY")
    error_message = "ca_cert must be the CA certificate in PEM (and no private key: ca.key stays offline)."
  }
}

variable "controller" {
  description = "The controller's certificate and key (PEM: controller.crt, controller.key)."
  type = object({
    cert = string
    key  = string
  })
  sensitive = true
}

variable "balancers" {
  description = "Per region, its balancer's certificate and key (PEM: balancer-<region>.crt, balancer-<region>.key)."
  type = map(object({
    cert = string
    key  = string
  }))
  sensitive = true

  validation {
    # region names are not secret: only the PEMs are
    condition     = sort(nonsensitive(keys(var.balancers))) == sort(var.regions)
    error_message = "balancers must hold exactly one certificate and key per entry of regions."
  }
}

variable "peer_token" {
  description = "The mesh's peer token (peer-token of `skymesh pki issue`): balancers read it, the controller does not."
  type        = string
  sensitive   = true

  validation {
    # it lands in a systemd EnvironmentFile: no quoting or whitespace to get wrong
    condition     = can(regex("^[A-Za-z0-9._~+/=-]{16,}$", trimspace(var.peer_token)))
    error_message = "peer_token must be 16+ characters of A-Z a-z 0-9 . _ ~ + / = - (skymesh pki issue makes one)."
  }
}

variable "admin_token" {
  description = "The admin token (admin-token of `skymesh pki issue`): the controller reads it, balancers do not."
  type        = string
  sensitive   = true

  validation {
    condition     = length(trimspace(var.admin_token)) >= 16
    error_message = "admin_token must be at least 16 characters."
  }
}

variable "kms_key_arn" {
  description = "Customer-managed KMS key (ARN, same region as the secrets) that encrypts the secrets; null: the AWS managed key aws/secretsmanager. Readers are then granted kms:Decrypt on it through Secrets Manager only."
  type        = string
  default     = null

  validation {
    condition     = var.kms_key_arn == null || can(regex("^arn:aws[a-z-]*:kms:[a-z0-9-]+:[0-9]{12}:key/[A-Za-z0-9-]+$", coalesce(var.kms_key_arn, "x")))
    error_message = "kms_key_arn must be a KMS key ARN (arn:aws:kms:<region>:<account>:key/<id>), not an alias."
  }
}

variable "recovery_window_in_days" {
  description = "Days a deleted secret can be restored (0: deleted at once)."
  type        = number
  default     = 7

  validation {
    condition     = var.recovery_window_in_days == 0 || (var.recovery_window_in_days >= 7 && var.recovery_window_in_days <= 30)
    error_message = "recovery_window_in_days must be 0 or between 7 and 30."
  }
}

variable "host_dir" {
  description = "Directory on the instances where the fetch scripts put the files (the config module's credentials_dir)."
  type        = string
  default     = "/etc/skymesh/pki"

  validation {
    condition     = can(regex("^/[A-Za-z0-9._/-]+$", var.host_dir))
    error_message = "host_dir must be an absolute path of plain characters."
  }
}

variable "tags" {
  description = "Tags of every secret."
  type        = map(string)
  default     = {}
}
