output "balancer_private_ip" {
  description = "Private IP of the balancer (peers and the controller use it)."
  value       = aws_instance.balancer.private_ip
}

output "balancer_public_ip" {
  description = "Elastic IP of the balancer (Route53 records and health checks point here); known before the instances exist."
  value       = aws_eip.balancer.public_ip
}

output "replica_private_ips" {
  description = "Private IPs of the vLLM replicas."
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
  description = "This region's subnet (the controller may share it)."
  value       = aws_subnet.this.id
}

output "route_table_id" {
  description = "Route table of the subnet (peering routes go here)."
  value       = aws_route_table.this.id
}

output "balancer_role_name" {
  description = "IAM role of the balancer instance."
  value       = aws_iam_role.balancer.name
}

output "credentials_policy" {
  description = "The balancer role's policy document (JSON): what it may read from Secrets Manager (and decrypt with KMS)."
  value       = local.credentials_policy
}
