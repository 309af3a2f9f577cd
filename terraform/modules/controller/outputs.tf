output "private_ip" {
  description = "Controller private IP."
  value       = aws_instance.this.private_ip
}

output "role_arn" {
  description = "IAM role of the controller."
  value       = aws_iam_role.this.arn
}

output "credentials_policy" {
  description = "The controller role's credentials policy (JSON): what it may read from Secrets Manager (and decrypt with KMS)."
  value       = local.credentials_policy
}

output "replica_discovery_policy" {
  description = "The controller role's replica discovery policy (JSON; membership.aws), null unless replica_discovery is set."
  value       = one(aws_iam_role_policy.discovery[*].policy)
}

output "entry_targets_policy" {
  description = "The controller role's policy (JSON) for moving balancers in and out of the regions' target groups (balancer.entry_target_groups), null unless entry_target_group_arns is set."
  value       = one(aws_iam_role_policy.entry_targets[*].policy)
}
