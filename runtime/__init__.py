"""Shared runtime pieces: settings, Kafka clients, status records, stores, model loading."""
