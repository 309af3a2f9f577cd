mock_provider "aws" {}

variables {
  zone_name   = "example.com"
  create_zone = true
  record_name = "llm.example.com"
  balancers = {
    "us-east-1" = { ip = "3.80.0.10" }
    "eu-west-1" = { ip = "52.16.0.10", port = 8080 }
  }
}

run "one_check_and_one_latency_record_per_balancer" {
  command = plan

  assert {
    condition     = length(aws_route53_record.latency) == 2 && length(aws_route53_health_check.balancer) == 2
    error_message = "one record and one health check per balancer"
  }
  assert {
    condition     = aws_route53_record.latency["eu-west-1"].set_identifier == "skymesh-eu-west-1"
    error_message = "SetIdentifier must follow the controller's skymesh-<region> scheme"
  }
  assert {
    condition     = aws_route53_health_check.balancer["eu-west-1"].port == 8080 && aws_route53_health_check.balancer["eu-west-1"].resource_path == "/health"
    error_message = "health checks probe the balancer's /health on its port"
  }
}

run "rejects_bad_ip" {
  command = plan
  variables {
    balancers = { "us-east-1" = { ip = "not-an-ip" } }
  }
  expect_failures = [var.balancers]
}
