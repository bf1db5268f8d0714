"""integration/tune"""
