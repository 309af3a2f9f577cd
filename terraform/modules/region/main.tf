# One mesh region as a fleet: a VPC with a subnet per availability zone; GPU replicas
# running vLLM (prefix caching on) as a systemd service, a static pool the config names
# plus an Auto Scaling group that tracks the balancers' autoscaling signal (CloudWatch
# SkyMesh/PendingPrefillSecondsPerReplica); N active-active balancers running `skymesh
# balancer` in an Auto Scaling group behind two Network Load Balancers: an
# internet-facing entry for clients (one Elastic IP per zone, DNS publishes the first)
# and an internal one for peers and the controller (fixed private IPs the config names).
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

# One subnet per availability zone (the first one also holds the static replicas and,
# in the example, the controller); both load balancers and both Auto Scaling groups span
# them all.
resource "aws_subnet" "this" {
  count             = length(var.availability_zones)
  vpc_id            = aws_vpc.this.id
  cidr_block        = cidrsubnet(var.vpc_cidr, 8, count.index)
  availability_zone = var.availability_zones[count.index]
  tags              = { Name = "skymesh-${var.name}-${var.availability_zones[count.index]}" }
}

resource "aws_route_table" "this" {
  vpc_id = aws_vpc.this.id
  route {
    cidr_block = "0.0.0.0/0"
    gateway_id = aws_internet_gateway.this.id
  }
}

resource "aws_route_table_association" "this" {
  count          = length(aws_subnet.this)
  subnet_id      = aws_subnet.this[count.index].id
  route_table_id = aws_route_table.this.id
}

resource "aws_security_group" "balancer" {
  name        = "skymesh-${var.name}-balancer"
  description = "skymesh balancer: OpenAI API from clients, gRPC heartbeats and mTLS forwards from peers"
  vpc_id      = aws_vpc.this.id

  ingress {
    description = "OpenAI API, /health for Route53 and controller checks"
    from_port   = var.ports.http
    to_port     = var.ports.http
    protocol    = "tcp"
    cidr_blocks = distinct(concat(var.client_cidrs, var.peer_cidrs))
  }
  ingress {
    description = "health checks of the load balancers (their nodes have addresses in this VPC) on /health"
    from_port   = var.ports.http
    to_port     = var.ports.http
    protocol    = "tcp"
    cidr_blocks = [var.vpc_cidr]
  }
  ingress {
    description = "gRPC heartbeats from peer balancers"
    from_port   = var.ports.grpc
    to_port     = var.ports.grpc
    protocol    = "tcp"
    cidr_blocks = var.peer_cidrs
  }
  ingress {
    description = "sibling channel: the balancers of this region dial each other (gRPC)"
    from_port   = var.ports.grpc
    to_port     = var.ports.grpc
    protocol    = "tcp"
    self        = true
  }
  ingress {
    description = "forwarded requests from peer balancers (HTTPS, mesh-CA client certificates)"
    from_port   = var.ports.peer
    to_port     = var.ports.peer
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
  # checkov:skip=CKV_AWS_260:the balancers are the public OpenAI endpoint (through the entry load balancer, which keeps client addresses); the HTTP port must be reachable by clients
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


data "aws_ami" "this" {
  filter {
    name   = "image-id"
    values = [var.ami_id]
  }
}

locals {
  # the AMI's root device (/dev/sda1 on Ubuntu-based Deep Learning AMIs, /dev/xvda on
  # Amazon Linux): the launch templates encrypt and size that one
  root_device_name = data.aws_ami.this.root_device_name
  replica_tags     = { "skymesh:role" = "replica", "skymesh:region" = var.name }
  balancer_tags    = { "skymesh:role" = "balancer", "skymesh:region" = var.name }
}

# The static pool: replicas at the fixed private IPs the config names (may be empty).
resource "aws_instance" "replica" {
  count                       = length(var.replica_private_ips)
  ami                         = var.ami_id
  instance_type               = var.replica_instance_type
  subnet_id                   = aws_subnet.this[0].id
  private_ip                  = var.replica_private_ips[count.index]
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
  tags = merge(local.replica_tags, { Name = "skymesh-${var.name}-replica-${count.index}" })
  # checkov:skip=CKV2_AWS_41:replicas need no AWS API access, so no IAM role is attached
  # checkov:skip=CKV_AWS_88:replicas download weights over the internet gateway; no NAT in this minimal layout
}

# The scaling pool: the same replica, launched by an Auto Scaling group that a target
# tracking policy sizes on the balancers' signal.
resource "aws_launch_template" "replica" {
  name_prefix   = "skymesh-${var.name}-replica-"
  image_id      = var.ami_id
  instance_type = var.replica_instance_type
  user_data     = base64encode(local.vllm_cloud_init)
  ebs_optimized = true

  network_interfaces {
    associate_public_ip_address = true
    security_groups             = [aws_security_group.replica.id]
    delete_on_termination       = true
  }
  metadata_options {
    http_tokens                 = "required"
    http_endpoint               = "enabled"
    http_put_response_hop_limit = 1
  }
  monitoring {
    enabled = true
  }
  block_device_mappings {
    device_name = local.root_device_name
    ebs {
      encrypted             = true
      volume_size           = 200
      volume_type           = "gp3"
      delete_on_termination = true
    }
  }
  tag_specifications {
    resource_type = "instance"
    tags          = merge(local.replica_tags, { Name = "skymesh-${var.name}-replica" })
  }
  # checkov:skip=CKV_AWS_88:replicas download weights over the internet gateway; no NAT in this minimal layout
}

resource "aws_autoscaling_group" "replica" {
  # a fixed name, known at plan: the config (membership.aws) names the group, and every
  # instance gets that config at boot
  name                = "skymesh-${var.name}-replica"
  min_size            = var.replica_scaling.min_size
  max_size            = var.replica_scaling.max_size
  desired_capacity    = var.replica_scaling.desired_capacity
  vpc_zone_identifier = aws_subnet.this[*].id
  # a GPU replica installs vLLM and loads its weights before it serves
  health_check_grace_period = 900
  default_instance_warmup   = 900

  launch_template {
    id      = aws_launch_template.replica.id
    version = aws_launch_template.replica.latest_version
  }
  dynamic "tag" {
    for_each = local.replica_tags
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }
  lifecycle {
    # the scaling policy owns the size once the group exists
    ignore_changes = [desired_capacity]
  }
}

# Scale-in drains: an instance the group terminates waits in Terminating:Wait (no longer
# InService, so the controller's next membership.aws poll drops it and its balancer
# drains it) for termination_wait_s, then stops (CONTINUE: nothing has to complete the
# action).
resource "aws_autoscaling_lifecycle_hook" "replica_drain" {
  name                   = "skymesh-${var.name}-replica-drain"
  autoscaling_group_name = aws_autoscaling_group.replica.name
  lifecycle_transition   = "autoscaling:EC2_INSTANCE_TERMINATING"
  default_result         = "CONTINUE"
  heartbeat_timeout      = var.replica_scaling.termination_wait_s
}

# Keep the predicted seconds of prefill work waiting per healthy replica at the target:
# the balancers publish it (skymesh/balancer/autoscaling_signal.py) every interval.
resource "aws_autoscaling_policy" "replica_pending_prefill" {
  name                   = "skymesh-${var.name}-pending-prefill-per-replica"
  autoscaling_group_name = aws_autoscaling_group.replica.name
  policy_type            = "TargetTrackingScaling"

  target_tracking_configuration {
    target_value = var.replica_scaling.target_pending_prefill_s
    customized_metric_specification {
      namespace   = var.autoscaling_metric.namespace
      metric_name = var.autoscaling_metric.name
      statistic   = "Average"
      metric_dimension {
        name  = "Region"
        value = var.name
      }
    }
  }
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
  # PutMetricData has no resource-level permissions; the namespace condition is the bound
  metrics_policy = jsonencode({
    Version = "2012-10-17"
    Statement = [{
      Sid       = "PublishTheAutoscalingSignalOnly"
      Effect    = "Allow"
      Action    = ["cloudwatch:PutMetricData"]
      Resource  = "*"
      Condition = { StringEquals = { "cloudwatch:namespace" = var.autoscaling_metric.namespace } }
    }]
  })
}

resource "aws_iam_role_policy" "balancer_credentials" {
  name   = "skymesh-${var.name}-balancer-credentials"
  role   = aws_iam_role.balancer.id
  policy = local.credentials_policy
}

resource "aws_iam_role_policy" "balancer_metrics" {
  name   = "skymesh-${var.name}-balancer-metrics"
  role   = aws_iam_role.balancer.id
  policy = local.metrics_policy
}

resource "aws_iam_instance_profile" "balancer" {
  name = "skymesh-${var.name}-balancer"
  role = aws_iam_role.balancer.name
}

locals {
  balancer_cloud_init = <<-EOT
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
          # its identity in the region's fleet (the config lists no balancer: fleet =
          # registered): the instance id and private IPv4 from IMDSv2 (hop limit 1 is
          # enough for a process on the instance); SKYMESH_BALANCER_ID and
          # SKYMESH_ADVERTISE_HOST in an Environment= line would override them
          ExecStart=/opt/skymesh/bin/skymesh balancer --config /etc/skymesh/mesh.yaml --region ${var.name} --drain-listen-s ${local.balancer_drain_listen_s} --drain-timeout-s ${local.balancer_drain_timeout_s}
          ExecReload=/bin/kill -HUP $MAINPID
          # SIGTERM drains: deregister (DNS moves), fail /health while still serving for
          # --drain-listen-s (the target groups' checks take the instance out meanwhile), close
          # the listeners, finish accepted requests within --drain-timeout-s; systemd must
          # not SIGKILL the drain before that
          TimeoutStopSec=${local.balancer_drain_listen_s + local.balancer_drain_timeout_s + 10}
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
}

# Every balancer of the region boots from this template: the same config, the same role
# (so each fetches the region's credentials before every start).
resource "aws_launch_template" "balancer" {
  name_prefix   = "skymesh-${var.name}-balancer-"
  image_id      = var.ami_id
  instance_type = var.balancer_instance_type
  user_data     = base64encode(local.balancer_cloud_init)
  ebs_optimized = true

  iam_instance_profile {
    arn = aws_iam_instance_profile.balancer.arn
  }
  network_interfaces {
    # egress to peers over peering, to Secrets Manager and to the package index; clients
    # reach the balancers through the entry load balancer only
    associate_public_ip_address = true
    security_groups             = [aws_security_group.balancer.id]
    delete_on_termination       = true
  }
  metadata_options {
    http_tokens                 = "required"
    http_endpoint               = "enabled"
    http_put_response_hop_limit = 1
  }
  monitoring {
    enabled = true
  }
  block_device_mappings {
    device_name = local.root_device_name
    ebs {
      encrypted             = true
      volume_size           = 30
      volume_type           = "gp3"
      delete_on_termination = true
    }
  }
  tag_specifications {
    resource_type = "instance"
    tags          = merge(local.balancer_tags, { Name = "skymesh-${var.name}-balancer" })
  }
  # checkov:skip=CKV_AWS_88:without a NAT gateway the balancers reach Secrets Manager, peers' public entries and the package index through a public address
}

resource "aws_autoscaling_group" "balancer" {
  name_prefix         = "skymesh-${var.name}-balancer-"
  min_size            = var.balancer_scaling.min_size
  max_size            = var.balancer_scaling.max_size
  desired_capacity    = var.balancer_scaling.desired_capacity
  vpc_zone_identifier = aws_subnet.this[*].id
  # a balancer the load balancers find unhealthy (its /health) is replaced
  health_check_type         = "ELB"
  health_check_grace_period = 600
  target_group_arns         = [for tg in aws_lb_target_group.balancer : tg.arn]

  launch_template {
    id      = aws_launch_template.balancer.id
    version = aws_launch_template.balancer.latest_version
  }
  # a new template (config, package) rolls through the fleet, keeping half serving
  instance_refresh {
    strategy = "Rolling"
    preferences {
      min_healthy_percentage = 50
    }
  }
  dynamic "tag" {
    for_each = local.balancer_tags
    content {
      key                 = tag.key
      value               = tag.value
      propagate_at_launch = true
    }
  }
  # the grant exists before any balancer boots and fetches its credentials
  depends_on = [aws_iam_role_policy.balancer_credentials, aws_iam_role_policy.balancer_metrics]
}

# The region's two entries. "entry": internet-facing, the OpenAI API for clients, one
# Elastic IP per zone (allocated before anything else, so the config and Route53 can name
# them). "mesh": internal, at fixed private IPs the config advertises: peers' heartbeats
# (gRPC) and forwards (mTLS), the controller's /health probes and peers' HTTP.
locals {
  listeners = {
    entry_http = { lb = "entry", port = var.ports.http }
    mesh_http  = { lb = "mesh", port = var.ports.http }
    mesh_grpc  = { lb = "mesh", port = var.ports.grpc }
    mesh_peer  = { lb = "mesh", port = var.ports.peer }
  }
  mesh_private_ips = [for s in range(length(var.availability_zones)) : cidrhost(cidrsubnet(var.vpc_cidr, 8, s), 10)]
}

resource "aws_eip" "entry" {
  count  = length(var.availability_zones)
  domain = "vpc"
  tags   = { Name = "skymesh-${var.name}-entry-${var.availability_zones[count.index]}" }
  # checkov:skip=CKV2_AWS_19:attached to the entry network load balancer (its subnet_mapping), not to an instance
}

resource "aws_lb" "entry" {
  name                             = "skymesh-${substr(var.name, 0, 16)}-entry"
  load_balancer_type               = "network"
  internal                         = false
  enable_cross_zone_load_balancing = true

  dynamic "subnet_mapping" {
    for_each = aws_subnet.this
    content {
      subnet_id     = subnet_mapping.value.id
      allocation_id = aws_eip.entry[subnet_mapping.key].id
    }
  }
  tags = { Name = "skymesh-${var.name}-entry" }
  # checkov:skip=CKV_AWS_91:access logs need an S3 bucket and retention the operator chooses
  # checkov:skip=CKV_AWS_150:the example is torn down with terraform destroy; enable deletion protection per deployment
}

resource "aws_lb" "mesh" {
  name                             = "skymesh-${substr(var.name, 0, 16)}-mesh"
  load_balancer_type               = "network"
  internal                         = true
  enable_cross_zone_load_balancing = true

  dynamic "subnet_mapping" {
    for_each = aws_subnet.this
    content {
      subnet_id            = subnet_mapping.value.id
      private_ipv4_address = local.mesh_private_ips[subnet_mapping.key]
    }
  }
  tags = { Name = "skymesh-${var.name}-mesh" }
  # checkov:skip=CKV_AWS_91:access logs need an S3 bucket and retention the operator chooses
  # checkov:skip=CKV_AWS_150:the example is torn down with terraform destroy; enable deletion protection per deployment
}

locals {
  # the target groups' health checks of the balancers, and the drain they set: a draining
  # balancer fails /health but keeps serving until the checks have taken it out (interval x
  # unhealthy threshold, plus a margin), so no new connection meets its closing listener
  balancer_health_interval_s   = 10
  balancer_unhealthy_threshold = 2
  balancer_drain_listen_s      = local.balancer_health_interval_s * local.balancer_unhealthy_threshold + 5
  balancer_drain_timeout_s     = 30
}

# One target group per listener (a network load balancer's target group serves one load
# balancer); every balancer of the group registers in all four. Each checks the
# balancer's /health over HTTP; a draining balancer fails it first, so it leaves every
# listener together, before its listeners close.
resource "aws_lb_target_group" "balancer" {
  for_each             = local.listeners
  name                 = "skymesh-${substr(var.name, 0, 13)}-${replace(each.key, "_", "-")}"
  port                 = each.value.port
  protocol             = "TCP"
  vpc_id               = aws_vpc.this.id
  target_type          = "instance"
  deregistration_delay = 45
  # peers and the controller must be seen from their own addresses (security groups,
  # the region's source networks)
  preserve_client_ip = "true"

  health_check {
    protocol            = "HTTP"
    port                = tostring(var.ports.http)
    path                = "/health"
    matcher             = "200"
    interval            = local.balancer_health_interval_s
    healthy_threshold   = 2
    unhealthy_threshold = local.balancer_unhealthy_threshold
  }
}

resource "aws_lb_listener" "balancer" {
  for_each          = local.listeners
  load_balancer_arn = each.value.lb == "entry" ? aws_lb.entry.arn : aws_lb.mesh.arn
  port              = each.value.port
  protocol          = "TCP"

  default_action {
    type             = "forward"
    target_group_arn = aws_lb_target_group.balancer[each.key].arn
  }
  # checkov:skip=CKV_AWS_2:TCP pass-through: the balancer terminates the peer mTLS itself; the client API is HTTP as before the load balancer
  # checkov:skip=CKV_AWS_103:TCP pass-through, no TLS policy at the load balancer
}
