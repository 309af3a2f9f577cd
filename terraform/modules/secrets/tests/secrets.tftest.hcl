# Mock AWS (nothing real is created, so `apply` gives the secrets distinct mock ARNs):
# one secret per component, and each reader's list names exactly what it needs.
mock_provider "aws" {}

variables {
  regions    = ["us-east-1", "eu-west-1"]
  ca_cert    = "-----BEGIN CERTIFICATE-----\nca\n-----END CERTIFICATE-----\n"
  controller = { cert = "controller cert", key = "controller key" }
  balancers = {
    "us-east-1" = { cert = "use1 cert", key = "use1 key" }
    "eu-west-1" = { cert = "euw1 cert", key = "euw1 key" }
  }
  peer_token  = "peer-token-0123456789abcdef"
  admin_token = "admin-token-0123456789abcdef"
}

run "one_secret_per_component_and_least_privilege_lists" {
  command = apply

  assert {
    condition     = toset(keys(aws_secretsmanager_secret.this)) == toset(["ca-cert", "peer-token", "admin-token", "controller", "balancer/us-east-1", "balancer/eu-west-1"])
    error_message = "one secret per component plus the CA certificate and the two tokens"
  }
  assert {
    condition     = aws_secretsmanager_secret.this["balancer/eu-west-1"].name == "skymesh/balancer/eu-west-1" && aws_secretsmanager_secret.this["ca-cert"].name == "skymesh/ca-cert"
    error_message = "secret names are <prefix>/<key>"
  }
  assert {
    condition     = length(distinct(values(output.secret_arns))) == 6
    error_message = "every secret has its own ARN"
  }
  assert {
    condition     = output.balancers["eu-west-1"].secret_arns == [output.secret_arns["ca-cert"], output.secret_arns["peer-token"], output.secret_arns["balancer/eu-west-1"]]
    error_message = "a balancer reads the CA certificate, the peer token and its own pair, nothing else"
  }
  assert {
    condition     = !contains(output.balancers["eu-west-1"].secret_arns, output.secret_arns["balancer/us-east-1"]) && !contains(output.balancers["eu-west-1"].secret_arns, output.secret_arns["admin-token"]) && !contains(output.balancers["eu-west-1"].secret_arns, output.secret_arns["controller"])
    error_message = "a balancer must not read another region's key, the controller's key or the admin token"
  }
  assert {
    condition     = output.controller.secret_arns == [output.secret_arns["ca-cert"], output.secret_arns["admin-token"], output.secret_arns["controller"]]
    error_message = "the controller reads the CA certificate, the admin token and its own pair, nothing else"
  }
  assert {
    condition     = alltrue([for r in ["us-east-1", "eu-west-1"] : !contains(output.controller.secret_arns, output.secret_arns["balancer/${r}"])]) && !contains(output.controller.secret_arns, output.secret_arns["peer-token"])
    error_message = "the controller must not read a balancer's key or the peer token"
  }
  assert {
    condition     = alltrue([for k, s in aws_secretsmanager_secret.this : s.kms_key_id == null && s.recovery_window_in_days == 7])
    error_message = "no customer key by default (aws/secretsmanager); a 7-day recovery window"
  }
}

run "fetch_scripts_read_only_their_component" {
  command = apply

  assert {
    condition     = strcontains(output.balancers["eu-west-1"].fetch_script, output.secret_arns["balancer/eu-west-1"]) && !strcontains(output.balancers["eu-west-1"].fetch_script, output.secret_arns["balancer/us-east-1"])
    error_message = "a balancer's script fetches its own pair only"
  }
  assert {
    condition     = strcontains(output.balancers["eu-west-1"].fetch_script, "SKYMESH_PEER_TOKEN=%s") && strcontains(output.balancers["eu-west-1"].fetch_script, "\"$tmp/balancer-eu-west-1\"") && !strcontains(output.balancers["eu-west-1"].fetch_script, output.secret_arns["admin-token"])
    error_message = "a balancer's script writes balancer-<region>.{crt,key} and the peer token's environment file, never the admin token"
  }
  assert {
    condition     = strcontains(output.controller.fetch_script, output.secret_arns["admin-token"]) && !strcontains(output.controller.fetch_script, output.secret_arns["peer-token"]) && strcontains(output.controller.fetch_script, "\"$tmp/controller\"")
    error_message = "the controller's script fetches the admin token and controller.{crt,key}, not the peer token"
  }
  assert {
    condition     = strcontains(output.controller.fetch_script, "umask 077") && strcontains(output.controller.fetch_script, "dir='/etc/skymesh/pki'") && strcontains(output.controller.fetch_script, "chmod 0600")
    error_message = "files are written 0600 under host_dir"
  }
  assert {
    condition     = !strcontains(output.balancers["us-east-1"].fetch_script, "use1 key") && !strcontains(output.controller.fetch_script, "peer-token-0123456789abcdef")
    error_message = "no secret value in a script (they are outputs, not sensitive)"
  }
}

run "customer_managed_key" {
  command = apply
  variables {
    kms_key_arn = "arn:aws:kms:us-east-1:123456789012:key/0e7d1c4a-1111-2222-3333-444455556666"
  }

  assert {
    condition     = alltrue([for k, s in aws_secretsmanager_secret.this : s.kms_key_id == var.kms_key_arn])
    error_message = "every secret is encrypted with the given key"
  }
  assert {
    condition     = output.balancers["us-east-1"].kms_key_arn == var.kms_key_arn && output.controller.kms_key_arn == var.kms_key_arn
    error_message = "readers learn the key so their roles can be granted kms:Decrypt"
  }
}

run "rejects_an_alias_a_ca_key_and_a_bad_token" {
  command = plan
  variables {
    kms_key_arn = "alias/aws/secretsmanager"
    ca_cert     = "-----BEGIN CERTIFICATE-----\n-----BEGIN PRIVATE KEY-----\n"
    peer_token  = "has a space in it 0123"
  }
  expect_failures = [var.kms_key_arn, var.ca_cert, var.peer_token]
}

run "rejects_a_region_without_its_pair" {
  command = plan
  variables {
    regions = ["us-east-1", "eu-west-1", "ap-northeast-1"]
  }
  expect_failures = [var.balancers]
}
