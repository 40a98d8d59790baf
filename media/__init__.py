"""Decoding what clients send, images and videos, bounded before any decoder runs."""
