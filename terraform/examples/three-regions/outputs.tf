output "skymesh_config" {
  description = "`terraform output -raw skymesh_config > mesh.yaml` feeds `skymesh status --config mesh.yaml`."
  value       = module.config.skymesh_config
  sensitive   = true
}

output "balancer_public_ips" {
  description = "Per region, the Elastic IP of its entry load balancer that DNS publishes (the balancers behind it are an Auto Scaling group)."
  value       = local.balancer_public_ip
}

output "entry_dns_names" {
  description = "Per region, the DNS name of its internet-facing entry load balancer."
  value = {
    "us-east-1"      = module.use1.entry_dns_name
    "eu-west-1"      = module.euw1.entry_dns_name
    "ap-northeast-1" = module.apne1.entry_dns_name
  }
}

output "autoscaling_groups" {
  description = "Per region, its Auto Scaling groups: the balancers and the scaling pool of replicas."
  value = {
    "us-east-1"      = { balancers = module.use1.balancer_asg_name, replicas = module.use1.replica_asg_name }
    "eu-west-1"      = { balancers = module.euw1.balancer_asg_name, replicas = module.euw1.replica_asg_name }
    "ap-northeast-1" = { balancers = module.apne1.balancer_asg_name, replicas = module.apne1.replica_asg_name }
  }
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
