"""integration/analysis"""
