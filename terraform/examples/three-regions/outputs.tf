output "skymesh_config" {
  description = "`terraform output -raw skymesh_config > mesh.yaml` feeds `skymesh status --config mesh.yaml`."
  value       = module.config.skymesh_config
  sensitive   = true
}

output "balancer_public_ips" {
  description = "Public IPs of the regional balancers."
  value = {
    "us-east-1"      = module.use1.balancer_public_ip
    "eu-west-1"      = module.euw1.balancer_public_ip
    "ap-northeast-1" = module.apne1.balancer_public_ip
  }
}
