output "zone_id" {
  description = "Hosted zone id."
  value       = local.zone_id
}

output "health_check_ids" {
  description = "Health check id per region."
  value       = { for k, v in aws_route53_health_check.balancer : k => v.id }
}

output "record_set_identifiers" {
  description = "Latency record SetIdentifier per region."
  value       = { for k, v in aws_route53_record.latency : k => v.set_identifier }
}
