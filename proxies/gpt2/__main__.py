from proxies.gpt2.proxy import entry

entry()
