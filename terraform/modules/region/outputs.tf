output "balancer_private_ip" {
  description = "The region's address for peers and the controller: the internal (mesh) load balancer's fixed private IP in the first subnet, known at plan (the config advertises it)."
  value       = local.mesh_private_ips[0]
}

output "balancer_private_ips" {
  description = "The mesh load balancer's fixed private IPs, one per subnet."
  value       = local.mesh_private_ips
}

output "balancer_public_ip" {
  description = "The entry load balancer's Elastic IP in the first subnet (Route53 records and health checks point here); allocated before the instances exist."
  value       = aws_eip.entry[0].public_ip
}

output "balancer_public_ips" {
  description = "The entry load balancer's Elastic IPs, one per subnet (each reaches every balancer: cross-zone is on)."
  value       = aws_eip.entry[*].public_ip
}

output "entry_dns_name" {
  description = "DNS name of the internet-facing entry load balancer (resolves to its Elastic IPs)."
  value       = aws_lb.entry.dns_name
}

output "mesh_dns_name" {
  description = "DNS name of the internal mesh load balancer (resolves to its fixed private IPs)."
  value       = aws_lb.mesh.dns_name
}

output "entry_target_group_arns" {
  description = "The target groups of the region's balancers (the entry's and the mesh load balancer's listeners): the config's balancer.entry_target_groups, from which the controller deregisters a balancer it finds dead and registers it again when alive."
  value       = [for k in sort(keys(aws_lb_target_group.balancer)) : aws_lb_target_group.balancer[k].arn]
}

output "balancer_asg_name" {
  description = "Auto Scaling group of the region's balancers."
  value       = aws_autoscaling_group.balancer.name
}

output "replica_asg_name" {
  description = "Auto Scaling group of the scaling pool of replicas (tagged skymesh:role = replica, skymesh:region = name): skymesh-<name>-replica, known at plan (the config module's regions[].replica_asg_names)."
  value       = aws_autoscaling_group.replica.name
}

output "replica_termination_wait_s" {
  description = "Seconds an instance the replica group terminates waits (its termination lifecycle hook) before it stops, to drain."
  value       = aws_autoscaling_lifecycle_hook.replica_drain.heartbeat_timeout
}

output "replica_private_ips" {
  description = "Private IPs of the static pool of replicas."
  value       = aws_instance.replica[*].private_ip
}

output "vpc_cidr" {
  description = "This region's VPC CIDR."
  value       = aws_vpc.this.cidr_block
}

output "vpc_id" {
  description = "This region's VPC (for peering and the controller)."
  value       = aws_vpc.this.id
}

output "subnet_id" {
  description = "This region's first subnet (the controller may share it)."
  value       = aws_subnet.this[0].id
}

output "subnet_ids" {
  description = "This region's subnets, one per availability zone."
  value       = aws_subnet.this[*].id
}

output "route_table_id" {
  description = "Route table of the subnets (peering routes go here)."
  value       = aws_route_table.this.id
}

output "balancer_role_name" {
  description = "IAM role of the balancer instances."
  value       = aws_iam_role.balancer.name
}

output "credentials_policy" {
  description = "The balancer role's policy document (JSON): what it may read from Secrets Manager (and decrypt with KMS)."
  value       = local.credentials_policy
}

output "metrics_policy" {
  description = "The balancer role's policy document (JSON) for the autoscaling signal: PutMetricData in its namespace only."
  value       = local.metrics_policy
}

output "replica_scaling_metric" {
  description = "The CloudWatch metric the replicas' target tracking policy follows: namespace, name, its Region dimension, the target."
  value = {
    namespace    = aws_autoscaling_policy.replica_pending_prefill.target_tracking_configuration[0].customized_metric_specification[0].namespace
    name         = aws_autoscaling_policy.replica_pending_prefill.target_tracking_configuration[0].customized_metric_specification[0].metric_name
    region       = one([for d in aws_autoscaling_policy.replica_pending_prefill.target_tracking_configuration[0].customized_metric_specification[0].metric_dimension : d.value if d.name == "Region"])
    target_value = aws_autoscaling_policy.replica_pending_prefill.target_tracking_configuration[0].target_value
  }
}
