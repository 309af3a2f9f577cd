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

output "secret_arns" {
  description = "The mesh credentials' secrets (ARNs, no values), by key."
  value       = module.secrets.secret_arns
}

output "balancer_credentials_policies" {
  description = "Per region, what its balancer role may read (policy JSON)."
  value = {
    "us-east-1"      = module.use1.credentials_policy
    "eu-west-1"      = module.euw1.credentials_policy
    "ap-northeast-1" = module.apne1.credentials_policy
  }
}

output "controller_credentials_policy" {
  description = "What the controller role may read (policy JSON)."
  value       = module.controller.credentials_policy
}
