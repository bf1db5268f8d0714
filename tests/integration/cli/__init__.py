"""integration/cli"""
