# Inter-region VPC peering between two mesh regions, with routes both ways. Balancers
# forward to peers, send gRPC heartbeats and (after a failover) adopt a dead region's
# replicas over private addresses; the controller probes balancers the same way.
terraform {
  required_version = ">= 1.6"
  required_providers {
    aws = {
      source                = "hashicorp/aws"
      version               = ">= 5.0, < 6.0"
      configuration_aliases = [aws.requester, aws.accepter]
    }
  }
}

resource "aws_vpc_peering_connection" "this" {
  provider    = aws.requester
  vpc_id      = var.requester.vpc_id
  peer_vpc_id = var.accepter.vpc_id
  peer_region = var.accepter_region
  tags        = { Name = "skymesh ${var.name}" }
}

resource "aws_vpc_peering_connection_accepter" "this" {
  provider                  = aws.accepter
  vpc_peering_connection_id = aws_vpc_peering_connection.this.id
  auto_accept               = true
  tags                      = { Name = "skymesh ${var.name}" }
}

resource "aws_route" "requester_to_accepter" {
  provider                  = aws.requester
  route_table_id            = var.requester.route_table_id
  destination_cidr_block    = var.accepter.cidr
  vpc_peering_connection_id = aws_vpc_peering_connection_accepter.this.id
}

resource "aws_route" "accepter_to_requester" {
  provider                  = aws.accepter
  route_table_id            = var.accepter.route_table_id
  destination_cidr_block    = var.requester.cidr
  vpc_peering_connection_id = aws_vpc_peering_connection_accepter.this.id
}
