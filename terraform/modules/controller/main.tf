# The central controller: one instance, an IAM role limited to the mesh's Route53 zone.
terraform {
  required_version = ">= 1.6"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.0, < 6.0"
    }
  }
}

data "aws_iam_policy_document" "assume" {
  statement {
    actions = ["sts:AssumeRole"]
    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "route53" {
  statement {
    sid       = "ChangeOnlyTheMeshZone"
    actions   = ["route53:ChangeResourceRecordSets", "route53:ListResourceRecordSets", "route53:GetHostedZone"]
    resources = ["arn:aws:route53:::hostedzone/${var.hosted_zone_id}"]
  }
  statement {
    sid       = "WaitForChanges"
    actions   = ["route53:GetChange"]
    resources = ["arn:aws:route53:::change/*"]
  }
  statement {
    sid       = "HealthChecksOfTheMesh"
    actions   = ["route53:DeleteHealthCheck", "route53:GetHealthCheck", "route53:ChangeTagsForResource"]
    resources = ["arn:aws:route53:::healthcheck/*"]
  }
  statement {
    # these APIs have no resource-level permissions: AWS only accepts "*" here
    sid       = "ApisWithoutResourceLevelPermissions"
    actions   = ["route53:ListHostedZonesByName", "route53:ListHealthChecks", "route53:CreateHealthCheck"]
    resources = ["*"]
  }
}

resource "aws_iam_role" "this" {
  name               = var.name
  assume_role_policy = data.aws_iam_policy_document.assume.json
}

resource "aws_iam_role_policy" "route53" {
  name   = "${var.name}-route53"
  role   = aws_iam_role.this.id
  policy = data.aws_iam_policy_document.route53.json
}

# membership.aws: the controller lists the replicas' Auto Scaling groups and instances.
# Read-only; these Describe APIs have no resource-level permissions (AWS only accepts "*"),
# so the bound is the AWS regions they may be called in (replica_discovery_regions).
resource "aws_iam_role_policy" "discovery" {
  count = var.replica_discovery ? 1 : 0
  name  = "${var.name}-replica-discovery"
  role  = aws_iam_role.this.id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [merge(
      {
        Sid      = "ListReplicasReadOnly"
        Effect   = "Allow"
        Action   = ["autoscaling:DescribeAutoScalingGroups", "ec2:DescribeInstances"]
        Resource = "*"
      },
      length(var.replica_discovery_regions) == 0 ? {} : {
        Condition = { StringEquals = { "aws:RequestedRegion" = sort(distinct(var.replica_discovery_regions)) } }
      },
    )]
  })
}

# balancer.entry_target_groups: a balancer the controller finds dead (its probes, its
# siblings' reports) leaves the load balancers' target groups at once, sooner than their own
# health checks, and comes back when alive. Only these two calls, only on these groups.
resource "aws_iam_role_policy" "entry_targets" {
  count = length(var.entry_target_group_arns) > 0 ? 1 : 0
  name  = "${var.name}-entry-targets"
  role  = aws_iam_role.this.id
  policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Sid      = "MoveBalancersInAndOutOfTheEntry"
      Effect   = "Allow"
      Action   = ["elasticloadbalancing:DeregisterTargets", "elasticloadbalancing:RegisterTargets"]
      Resource = sort(distinct(var.entry_target_group_arns))
    }]
  })
}

# The controller's mesh credentials (the CA certificate, the admin token, its own
# certificate and key) and nothing else: no balancer's key, not the peer token.
locals {
  credentials_policy = jsonencode({
    Version = "2012-10-17"
    Statement = concat(
      [{
        Sid      = "ReadOwnMeshCredentials"
        Effect   = "Allow"
        Action   = ["secretsmanager:GetSecretValue"]
        Resource = var.credentials.secret_arns
      }],
      var.credentials.kms_key_arn == null ? [] : [{
        Sid      = "DecryptThemThroughSecretsManagerOnly"
        Effect   = "Allow"
        Action   = ["kms:Decrypt"]
        Resource = [var.credentials.kms_key_arn]
        # the key's region (the secrets' region) is the fourth field of its ARN
        Condition = { StringEquals = { "kms:ViaService" = "secretsmanager.${split(":", var.credentials.kms_key_arn)[3]}.amazonaws.com" } }
      }],
    )
  })
}

resource "aws_iam_role_policy" "credentials" {
  name   = "${var.name}-credentials"
  role   = aws_iam_role.this.id
  policy = local.credentials_policy
}

resource "aws_iam_instance_profile" "this" {
  name = var.name
  role = aws_iam_role.this.name
}

resource "aws_security_group" "this" {
  name        = var.name
  description = "skymesh controller: gRPC from balancers, status API from admins"
  vpc_id      = var.vpc_id

  ingress {
    description = "register/report/watch from balancers"
    from_port   = 7001
    to_port     = 7001
    protocol    = "tcp"
    cidr_blocks = var.balancer_cidrs
  }
  dynamic "ingress" {
    for_each = length(var.admin_cidrs) > 0 ? [1] : []
    content {
      description = "status API for skymesh status"
      from_port   = 7002
      to_port     = 7002
      protocol    = "tcp"
      cidr_blocks = var.admin_cidrs
    }
  }
  dynamic "ingress" {
    for_each = length(var.replica_cidrs) > 0 ? [1] : []
    content {
      description = "replica registration API (membership.registration)"
      from_port   = 7002
      to_port     = 7002
      protocol    = "tcp"
      cidr_blocks = var.replica_cidrs
    }
  }
  egress {
    description = "balancer health probes and the Route53 API"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
  # checkov:skip=CKV_AWS_382:the controller probes balancers in every region and calls the Route53 API
}

resource "aws_instance" "this" {
  ami                         = var.ami_id
  instance_type               = var.instance_type
  subnet_id                   = var.subnet_id
  private_ip                  = var.private_ip
  associate_public_ip_address = var.associate_public_ip
  vpc_security_group_ids      = [aws_security_group.this.id]
  iam_instance_profile        = aws_iam_instance_profile.this.name
  monitoring                  = true
  ebs_optimized               = true
  user_data_replace_on_change = true
  user_data                   = <<-EOT
    #cloud-config
    write_files:
      - path: /etc/skymesh/mesh.yaml
        permissions: "0600"
        encoding: b64
        content: ${base64encode(var.skymesh_config)}
      - path: /usr/local/sbin/skymesh-fetch-credentials
        permissions: "0700"
        encoding: b64
        content: ${base64encode(var.credentials.fetch_script)}
      - path: /etc/systemd/system/skymesh-controller.service
        content: |
          [Unit]
          Description=skymesh controller
          After=network-online.target
          # keep retrying while the instance role's grant propagates
          StartLimitIntervalSec=0
          [Service]
          # the CA certificate, the controller's certificate and key, and the admin token
          # (admin.token_file), from Secrets Manager, on every start
          ExecStartPre=/usr/local/sbin/skymesh-fetch-credentials
          ExecStart=/opt/skymesh/bin/skymesh controller --config /etc/skymesh/mesh.yaml
          ExecReload=/bin/kill -HUP $MAINPID
          Restart=always
          RestartSec=5
          [Install]
          WantedBy=multi-user.target
    runcmd:
      - python3 -m venv /opt/skymesh
      - /opt/skymesh/bin/pip install '${var.skymesh_package}'
      - mkdir -p /var/lib/skymesh
      - systemctl daemon-reload
      - systemctl enable --now skymesh-controller
  EOT

  metadata_options {
    http_tokens   = "required"
    http_endpoint = "enabled"
  }
  root_block_device {
    encrypted   = true
    volume_size = 20
    volume_type = "gp3"
  }
  tags = { Name = var.name }
  # the grant exists before the instance boots and fetches its credentials
  depends_on = [aws_iam_role_policy.credentials]
  # checkov:skip=CKV_AWS_88:outbound access to the Route53 API and the package index without a NAT gateway; the security group admits only balancers (7001) and admin_cidrs (7002)
}
