"""What the service tells its operators: Prometheus metrics and one observation (counter, histogram, log line) per
request, shared by both doors."""
