from proxies.llama.proxy import entry

entry()
