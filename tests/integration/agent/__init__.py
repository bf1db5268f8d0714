"""integration/agent"""
