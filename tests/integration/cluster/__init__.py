"""integration/cluster"""
