"""integration/deaths"""
