# The mesh's credentials in AWS Secrets Manager, one secret per component, so that each
# instance role can be granted exactly what its component reads:
#
#   <prefix>/ca-cert             the mesh CA certificate          every balancer, the controller
#   <prefix>/peer-token          the peer token                   every balancer
#   <prefix>/admin-token         the admin token                  the controller
#   <prefix>/controller          {"cert": PEM, "key": PEM}        the controller
#   <prefix>/balancer/<region>   {"cert": PEM, "key": PEM}        that region's balancer
#
# The values come from `skymesh pki issue` (the CA key never leaves the operator). They are
# written with the write-only `secret_string_wo`, so they are in neither the plan nor the
# state; `secret_string_wo_version` is the first 48 bits of the value's SHA-256 (all the
# state keeps of it: nothing to recover a 256-bit token or key from), so an apply after
# re-issuing uploads exactly the changed values. A certificate and its key are one JSON secret: one
# version holds a matching pair, never a new certificate with the old key.
terraform {
  required_version = ">= 1.11" # write-only arguments
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.88, < 6.0" # secret_string_wo
    }
  }
}

locals {
  shared = ["ca-cert", "peer-token", "admin-token", "controller"]
  keys   = toset(concat(local.shared, [for r in var.regions : "balancer/${r}"]))
  values = merge(
    {
      "ca-cert"     = var.ca_cert
      "peer-token"  = trimspace(var.peer_token)
      "admin-token" = trimspace(var.admin_token)
      "controller"  = jsonencode({ cert = var.controller.cert, key = var.controller.key })
    },
    # a region without a pair fails var.balancers' validation; try() keeps this quiet
    { for r in var.regions : "balancer/${r}" => try(jsonencode({ cert = var.balancers[r].cert, key = var.balancers[r].key }), "") },
  )
  descriptions = merge(
    {
      "ca-cert"     = "skymesh mesh CA certificate (PEM)"
      "peer-token"  = "skymesh peer token (balancers)"
      "admin-token" = "skymesh admin token (controller)"
      "controller"  = "skymesh controller certificate and key (JSON: cert, key)"
    },
    { for r in var.regions : "balancer/${r}" => "skymesh balancer of ${r}: certificate and key (JSON: cert, key)" },
  )
}

resource "aws_secretsmanager_secret" "this" {
  for_each                = local.keys
  name                    = "${var.name_prefix}/${each.key}"
  description             = local.descriptions[each.key]
  kms_key_id              = var.kms_key_arn
  recovery_window_in_days = var.recovery_window_in_days
  tags                    = merge(var.tags, { "skymesh:credential" = each.key })
  # checkov:skip=CKV2_AWS_57:the values are issued offline by `skymesh pki issue` (no Lambda can re-issue a certificate under an offline CA); rotation is re-issue + apply + restart, see docs/deploy.md
  # checkov:skip=CKV_AWS_149:a customer-managed KMS key is optional (kms_key_arn); without one Secrets Manager encrypts with the AWS managed key aws/secretsmanager
}

resource "aws_secretsmanager_secret_version" "this" {
  for_each                 = local.keys
  secret_id                = aws_secretsmanager_secret.this[each.key].id
  secret_string_wo         = local.values[each.key]
  secret_string_wo_version = parseint(substr(sha256(local.values[each.key]), 0, 12), 16)
}

locals {
  arn = { for k, s in aws_secretsmanager_secret.this : k => s.arn }
  fetch = {
    dir              = var.host_dir
    ca_cert_arn      = local.arn["ca-cert"]
    peer_token_arn   = null
    admin_token_arn  = null
    identity_arn     = null
    identity         = null
    peer_token_env   = "SKYMESH_PEER_TOKEN"
    peer_token_file  = "peer-token.env"
    admin_token_file = "admin-token"
  }
  balancers = { for r in var.regions : r => {
    secret_arns = [local.arn["ca-cert"], local.arn["peer-token"], local.arn["balancer/${r}"]]
    kms_key_arn = var.kms_key_arn
    fetch_script = templatefile("${path.module}/fetch-credentials.sh.tftpl", merge(local.fetch, {
      identity       = "balancer-${r}"
      identity_arn   = local.arn["balancer/${r}"]
      peer_token_arn = local.arn["peer-token"]
    }))
  } }
  controller = {
    secret_arns = [local.arn["ca-cert"], local.arn["admin-token"], local.arn["controller"]]
    kms_key_arn = var.kms_key_arn
    fetch_script = templatefile("${path.module}/fetch-credentials.sh.tftpl", merge(local.fetch, {
      identity        = "controller"
      identity_arn    = local.arn["controller"]
      admin_token_arn = local.arn["admin-token"]
    }))
  }
}
