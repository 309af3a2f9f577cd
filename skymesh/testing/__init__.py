"""Test-support code that is not a test: real backends the integration tests run against."""
