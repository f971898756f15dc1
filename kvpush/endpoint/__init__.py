"""endpoint"""
