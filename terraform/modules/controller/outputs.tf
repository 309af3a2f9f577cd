output "private_ip" {
  description = "Controller private IP."
  value       = aws_instance.this.private_ip
}

output "role_arn" {
  description = "IAM role of the controller."
  value       = aws_iam_role.this.arn
}
