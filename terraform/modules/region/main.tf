# One mesh region: a VPC with one subnet, GPU replicas running vLLM (prefix caching on)
# as a systemd service, and a balancer instance running `skymesh balancer`.
terraform {
  required_version = ">= 1.6"
  required_providers {
    aws = {
      source  = "hashicorp/aws"
      version = ">= 5.0, < 6.0"
    }
  }
}

resource "aws_vpc" "this" {
  cidr_block           = var.vpc_cidr
  enable_dns_hostnames = true
  tags                 = { Name = "skymesh-${var.name}" }
  # checkov:skip=CKV2_AWS_11:VPC flow logs need a log destination and retention policy the operator chooses
}

# lock the default security group down: nothing in, nothing out
resource "aws_default_security_group" "this" {
  vpc_id = aws_vpc.this.id
}

resource "aws_internet_gateway" "this" {
  vpc_id = aws_vpc.this.id
}

resource "aws_subnet" "this" {
  vpc_id            = aws_vpc.this.id
  cidr_block        = cidrsubnet(var.vpc_cidr, 8, 0)
  availability_zone = var.availability_zone
  tags              = { Name = "skymesh-${var.name}" }
}

resource "aws_route_table" "this" {
  vpc_id = aws_vpc.this.id
  route {
    cidr_block = "0.0.0.0/0"
    gateway_id = aws_internet_gateway.this.id
  }
}

resource "aws_route_table_association" "this" {
  subnet_id      = aws_subnet.this.id
  route_table_id = aws_route_table.this.id
}

resource "aws_security_group" "balancer" {
  name        = "skymesh-${var.name}-balancer"
  description = "skymesh balancer: OpenAI API from clients, gRPC heartbeats and mTLS forwards from peers"
  vpc_id      = aws_vpc.this.id

  ingress {
    description = "OpenAI API, /health for Route53 and controller checks"
    from_port   = 8000
    to_port     = 8000
    protocol    = "tcp"
    cidr_blocks = distinct(concat(var.client_cidrs, var.peer_cidrs))
  }
  ingress {
    description = "gRPC heartbeats from peer balancers"
    from_port   = 9000
    to_port     = 9000
    protocol    = "tcp"
    cidr_blocks = var.peer_cidrs
  }
  ingress {
    description = "forwarded requests from peer balancers (HTTPS, mesh-CA client certificates)"
    from_port   = 8443
    to_port     = 8443
    protocol    = "tcp"
    cidr_blocks = var.peer_cidrs
  }
  egress {
    description = "replicas, peers, controller and package installation over HTTPS"
    from_port   = 0
    to_port     = 0
    protocol    = "-1"
    cidr_blocks = ["0.0.0.0/0"]
  }
  # checkov:skip=CKV_AWS_260:the balancer is the public OpenAI endpoint; port 8000 must be reachable by clients
  # checkov:skip=CKV_AWS_382:egress is needed to reach peers in other regions and package mirrors
}

resource "aws_security_group" "replica" {
  name        = "skymesh-${var.name}-replica"
  description = "vLLM replicas: only the balancer (and an adopting peer balancer) may call them"
  vpc_id      = aws_vpc.this.id

  ingress {
    description     = "vLLM OpenAI server from the balancer of this region"
    from_port       = 8000
    to_port         = 8000
    protocol        = "tcp"
    security_groups = [aws_security_group.balancer.id]
  }
  ingress {
    description = "vLLM from peer balancers adopting these replicas during failover"
    from_port   = 8000
    to_port     = 8000
    protocol    = "tcp"
    cidr_blocks = var.peer_cidrs
  }
  egress {
    description = "model and package downloads"
    from_port   = 443
    to_port     = 443
    protocol    = "tcp"
    cidr_blocks = ["0.0.0.0/0"]
  }
}

locals {
  vllm_cloud_init = <<-EOT
    #cloud-config
    write_files:
      - path: /etc/systemd/system/vllm.service
        content: |
          [Unit]
          Description=vLLM OpenAI server (skymesh replica)
          After=network-online.target
          [Service]
          ExecStart=/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server --host 0.0.0.0 --port 8000 --model ${var.model} --served-model-name ${var.model} --enable-prefix-caching
          Restart=always
          RestartSec=5
          [Install]
          WantedBy=multi-user.target
    runcmd:
      - python3 -m venv /opt/vllm
      - /opt/vllm/bin/pip install 'vllm==${var.vllm_version}'
      - systemctl daemon-reload
      - systemctl enable --now vllm
  EOT
}

resource "aws_instance" "replica" {
  count                       = var.replica_count
  ami                         = var.ami_id
  instance_type               = var.replica_instance_type
  subnet_id                   = aws_subnet.this.id
  private_ip                  = length(var.replica_private_ips) > 0 ? var.replica_private_ips[count.index] : null
  vpc_security_group_ids      = [aws_security_group.replica.id]
  associate_public_ip_address = true
  monitoring                  = true
  ebs_optimized               = true
  user_data                   = local.vllm_cloud_init

  metadata_options {
    http_tokens   = "required"
    http_endpoint = "enabled"
  }
  root_block_device {
    encrypted   = true
    volume_size = 200
    volume_type = "gp3"
  }
  tags = { Name = "skymesh-${var.name}-replica-${count.index}", "skymesh:role" = "replica" }
  # checkov:skip=CKV2_AWS_41:replicas need no AWS API access, so no IAM role is attached
  # checkov:skip=CKV_AWS_88:replicas download weights over the internet gateway; no NAT in this minimal layout
}

# The balancer's role may read its mesh credentials (the CA certificate, the peer token,
# its own certificate and key) and nothing else: no other region's key, not the
# controller's, not the admin token.
resource "aws_iam_role" "balancer" {
  name = "skymesh-${var.name}-balancer"
  assume_role_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Effect    = "Allow"
      Action    = "sts:AssumeRole"
      Principal = { Service = "ec2.amazonaws.com" }
    }]
  })
}

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

resource "aws_iam_role_policy" "balancer_credentials" {
  name   = "skymesh-${var.name}-balancer-credentials"
  role   = aws_iam_role.balancer.id
  policy = local.credentials_policy
}

resource "aws_iam_instance_profile" "balancer" {
  name = "skymesh-${var.name}-balancer"
  role = aws_iam_role.balancer.name
}

resource "aws_instance" "balancer" {
  ami                         = var.ami_id
  instance_type               = var.balancer_instance_type
  subnet_id                   = aws_subnet.this.id
  private_ip                  = var.balancer_private_ip
  vpc_security_group_ids      = [aws_security_group.balancer.id]
  iam_instance_profile        = aws_iam_instance_profile.balancer.name
  associate_public_ip_address = true
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
      - path: /etc/systemd/system/skymesh-balancer.service
        content: |
          [Unit]
          Description=skymesh regional balancer (${var.name})
          After=network-online.target
          # keep retrying while the instance role's grant propagates
          StartLimitIntervalSec=0
          [Service]
          # the CA certificate, this region's certificate and key, and the peer token, from
          # Secrets Manager, on every start (a restart picks up rotated values)
          ExecStartPre=/usr/local/sbin/skymesh-fetch-credentials
          EnvironmentFile=-${var.credentials_dir}/peer-token.env
          ExecStart=/opt/skymesh/bin/skymesh balancer --config /etc/skymesh/mesh.yaml --region ${var.name}
          ExecReload=/bin/kill -HUP $MAINPID
          # SIGTERM drains: deregister (DNS moves), then finish accepted requests within
          # --drain-timeout-s (30 s); systemd must not SIGKILL the drain before that
          TimeoutStopSec=45
          KillSignal=SIGTERM
          Restart=always
          RestartSec=2
          LimitNOFILE=65536
          [Install]
          WantedBy=multi-user.target
    runcmd:
      - python3 -m venv /opt/skymesh
      - /opt/skymesh/bin/pip install '${var.skymesh_package}'
      - systemctl daemon-reload
      - systemctl enable --now skymesh-balancer
  EOT

  metadata_options {
    http_tokens   = "required"
    http_endpoint = "enabled"
  }
  root_block_device {
    encrypted   = true
    volume_size = 30
    volume_type = "gp3"
  }
  tags = { Name = "skymesh-${var.name}-balancer", "skymesh:role" = "balancer" }
  # the grant exists before the instance boots and fetches its credentials
  depends_on = [aws_iam_role_policy.balancer_credentials]
  # checkov:skip=CKV_AWS_88:the balancer is the public endpoint that Route53 latency records point at
}

# A fixed public address, allocated before the instances: the config (which every
# instance receives at boot) and the Route53 records name it, so it must not depend on
# the instance. The association attaches it once the balancer exists.
resource "aws_eip" "balancer" {
  domain = "vpc"
  tags   = { Name = "skymesh-${var.name}-balancer" }
}

resource "aws_eip_association" "balancer" {
  allocation_id = aws_eip.balancer.id
  instance_id   = aws_instance.balancer.id
}
