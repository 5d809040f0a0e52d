"""Layer 8, entry points for Python users: the offline LLM class. The servers and the CLI are the serving
package, above this one."""
