# No output holds a secret value: ARNs, the KMS key ARN and the fetch scripts only.

output "secret_arns" {
  description = "ARN of every secret, by key (ca-cert, peer-token, admin-token, controller, balancer/<region>)."
  value       = local.arn
  depends_on  = [aws_secretsmanager_secret_version.this]
}

output "balancers" {
  description = "Per region, what its balancer reads (the region module's credentials variable): the secrets' ARNs (CA, peer token, its own pair), the KMS key and the boot-time fetch script."
  value       = local.balancers
  # an instance that boots as soon as its grant exists must find the values there
  depends_on = [aws_secretsmanager_secret_version.this]
}

output "controller" {
  description = "What the controller reads (the controller module's credentials variable): the secrets' ARNs (CA, admin token, its own pair), the KMS key and the boot-time fetch script."
  value       = local.controller
  depends_on  = [aws_secretsmanager_secret_version.this]
}

output "host_dir" {
  description = "Where the fetch scripts write the files on the instances."
  value       = var.host_dir
}
