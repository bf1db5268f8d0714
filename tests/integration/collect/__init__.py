"""integration/collect"""
