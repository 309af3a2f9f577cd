mock_provider "aws" {
  alias = "requester"
}

mock_provider "aws" {
  alias = "accepter"
}

variables {
  name            = "us-east-1<->eu-west-1"
  requester       = { vpc_id = "vpc-1", cidr = "10.10.0.0/16", route_table_id = "rtb-1" }
  accepter        = { vpc_id = "vpc-2", cidr = "10.20.0.0/16", route_table_id = "rtb-2" }
  accepter_region = "eu-west-1"
}

run "routes_both_ways" {
  command = plan

  providers = {
    aws.requester = aws.requester
    aws.accepter  = aws.accepter
  }

  assert {
    condition     = aws_route.requester_to_accepter.destination_cidr_block == "10.20.0.0/16" && aws_route.accepter_to_requester.destination_cidr_block == "10.10.0.0/16"
    error_message = "each side routes the other's CIDR through the peering"
  }
  assert {
    condition     = aws_vpc_peering_connection.this.peer_region == "eu-west-1" && aws_vpc_peering_connection_accepter.this.auto_accept
    error_message = "inter-region peering, accepted by the other side"
  }
}

run "rejects_bad_cidr" {
  command = plan

  providers = {
    aws.requester = aws.requester
    aws.accepter  = aws.accepter
  }

  variables {
    accepter = { vpc_id = "vpc-2", cidr = "10.20.0.0", route_table_id = "rtb-2" }
  }
  expect_failures = [var.accepter]
}
