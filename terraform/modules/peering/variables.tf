variable "name" {
  description = "Label for the peering, e.g. us-east-1<->eu-west-1."
  type        = string
}

variable "requester" {
  description = "The requesting region's VPC: id, CIDR and the route table of its subnet."
  type = object({
    vpc_id         = string
    cidr           = string
    route_table_id = string
  })

  validation {
    condition     = can(cidrhost(var.requester.cidr, 0))
    error_message = "requester.cidr must be a CIDR network like 10.10.0.0/16."
  }
}

variable "accepter" {
  description = "The accepting region's VPC: id, CIDR and the route table of its subnet."
  type = object({
    vpc_id         = string
    cidr           = string
    route_table_id = string
  })

  validation {
    condition     = can(cidrhost(var.accepter.cidr, 0))
    error_message = "accepter.cidr must be a CIDR network like 10.20.0.0/16."
  }
}

variable "accepter_region" {
  description = "AWS region of the accepting VPC."
  type        = string

  validation {
    condition     = can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]$", var.accepter_region))
    error_message = "accepter_region must be an AWS region like eu-west-1."
  }
}
