# Route53 for the mesh name: one HTTP health check and one latency record per regional
# balancer. The controller keeps these true at run time (skymesh/dns/route53.py uses the
# same SetIdentifier scheme, so it adopts what terraform created).
terraform {
  required_version = ">= 1.6"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.0, < 6.0"
    }
  }
}

resource "aws_route53_zone" "this" {
  count = var.create_zone ? 1 : 0
  name  = var.zone_name
  # checkov:skip=CKV2_AWS_38:DNSSEC signing needs a KMS key in us-east-1 and registrar DS records; enable per account
  # checkov:skip=CKV2_AWS_39:query logging needs a CloudWatch log group in us-east-1; opt-in per account
}

data "aws_route53_zone" "this" {
  count        = var.create_zone ? 0 : 1
  name         = var.zone_name
  private_zone = false
}

locals {
  zone_id = var.create_zone ? aws_route53_zone.this[0].zone_id : data.aws_route53_zone.this[0].zone_id
}

resource "aws_route53_health_check" "balancer" {
  for_each          = var.balancers
  ip_address        = each.value.ip
  port              = each.value.port
  type              = "HTTP"
  resource_path     = each.value.health_path
  request_interval  = 10
  failure_threshold = 3
  tags = {
    Name             = "skymesh ${each.key}"
    "skymesh:region" = each.key
  }
}

resource "aws_route53_record" "latency" {
  # checkov:skip=CKV2_AWS_23:the records point at balancer public IPs created by the region modules and passed in as variables
  for_each        = var.balancers
  zone_id         = local.zone_id
  name            = var.record_name
  type            = "A"
  ttl             = var.ttl
  records         = [each.value.ip]
  set_identifier  = "skymesh-${each.key}"
  health_check_id = aws_route53_health_check.balancer[each.key].id

  latency_routing_policy {
    region = coalesce(each.value.aws_region, each.key)
  }
}
