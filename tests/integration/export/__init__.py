"""integration/export"""
