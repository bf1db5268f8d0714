"""integration/inject"""
