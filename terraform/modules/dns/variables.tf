variable "zone_name" {
  description = "Public hosted zone, e.g. example.com."
  type        = string
}

variable "create_zone" {
  description = "Create the zone (true) or look up an existing public zone (false)."
  type        = bool
  default     = false
}

variable "record_name" {
  description = "The mesh name, e.g. llm.example.com."
  type        = string
}

variable "ttl" {
  description = "Record TTL in seconds (short, so failover is quick)."
  type        = number
  default     = 30

  validation {
    condition     = var.ttl >= 1 && var.ttl <= 86400
    error_message = "ttl must be between 1 and 86400 seconds."
  }
}

variable "balancers" {
  description = "Regional balancers by region name: public IP, HTTP port, AWS region for latency routing."
  type = map(object({
    ip          = string
    port        = optional(number, 8000)
    aws_region  = optional(string)
    health_path = optional(string, "/health")
  }))

  validation {
    condition     = alltrue([for b in values(var.balancers) : can(cidrhost("${b.ip}/32", 0))])
    error_message = "balancers[*].ip must be IPv4 addresses."
  }
}
