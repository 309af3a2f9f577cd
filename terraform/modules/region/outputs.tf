output "balancer_private_ip" {
  description = "Private IP of the balancer (peers and the controller use it)."
  value       = aws_instance.balancer.private_ip
}

output "balancer_public_ip" {
  description = "Public IP of the balancer (Route53 records point here)."
  value       = aws_instance.balancer.public_ip
}

output "replica_private_ips" {
  description = "Private IPs of the vLLM replicas."
  value       = aws_instance.replica[*].private_ip
}

output "vpc_cidr" {
  description = "This region's VPC CIDR."
  value       = aws_vpc.this.cidr_block
}
