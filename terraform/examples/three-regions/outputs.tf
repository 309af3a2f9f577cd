output "skymesh_config" {
  description = "`terraform output -raw skymesh_config > mesh.yaml` feeds `skymesh status --config mesh.yaml`."
  value       = module.config.skymesh_config
  sensitive   = true
}

output "balancer_public_ips" {
  description = "Public IPs of the regional balancers."
  value       = local.balancer_public_ip
}

output "controller_private_ip" {
  description = "The controller (gRPC 7001, status API 7002)."
  value       = module.controller.private_ip
}

output "zone_id" {
  description = "The hosted zone holding the mesh name."
  value       = module.dns.zone_id
}
