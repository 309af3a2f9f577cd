output "skymesh_config" {
  description = "The skymesh YAML config for this deployment."
  value       = yamlencode(local.config)
  sensitive   = true
}

output "region_names" {
  description = "Regions in the config, in order."
  value       = [for r in var.regions : r.name]
}
